//! Unit tests of the tokenizer (tiny synthetic vocabularies; the llama.cpp comparison is tests/tokenizer_llamacpp.rs).

use super::pretok::{RE_GPT2, RE_LLAMA3, RE_QWEN2};
use super::*;
use fancy_regex::Regex;
use proptest::prelude::*;

const SMOL_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const QWEN_TEMPLATE: &str = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}";

fn strs(v: &[&str]) -> MetaValue {
    MetaValue::Array(v.iter().map(|s| MetaValue::Str(s.to_string())).collect())
}

/// A tiny GPT-2 style vocabulary: the 256 byte characters, a few merges, ChatML tokens.
fn tiny_meta(pre: &str) -> HashMap<String, MetaValue> {
    let chars = bytes_to_unicode();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d",
    ];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool>",
        "[PAD0]",
    ];
    tokens.extend(specials.iter().map(|s| s.to_string()));
    let n_normal = tokens.len() - specials.len();
    let mut types = vec![MetaValue::I32(1); n_normal];
    types.extend([3, 3, 3, 4, 5].map(MetaValue::I32));
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut m = HashMap::new();
    m.insert("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into()));
    m.insert("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into()));
    m.insert("tokenizer.ggml.tokens".into(), strs(&tokens));
    m.insert("tokenizer.ggml.token_type".into(), MetaValue::Array(types));
    m.insert("tokenizer.ggml.merges".into(), strs(&merges));
    m.insert(
        "tokenizer.ggml.bos_token_id".into(),
        MetaValue::U32(n_normal as u32 + 1),
    );
    m.insert(
        "tokenizer.ggml.eos_token_id".into(),
        MetaValue::U32(n_normal as u32 + 2),
    );
    m.insert(
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(false),
    );
    m.insert(
        "tokenizer.chat_template".into(),
        MetaValue::Str(SMOL_TEMPLATE.into()),
    );
    m
}

/// Built once per pre-tokenizer and shared by the tests.
fn tiny(pre: &str) -> &'static Tokenizer {
    static CACHE: std::sync::Mutex<Vec<(String, &'static Tokenizer)>> =
        std::sync::Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = cache.iter().find(|(p, _)| p == pre) {
        return t;
    }
    let t: &'static Tokenizer = Box::leak(Box::new(
        Tokenizer::from_meta(&tiny_meta(pre)).expect("tiny tokenizer"),
    ));
    cache.push((pre.to_string(), t));
    t
}

#[test]
fn tokenizer_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}

#[test]
fn byte_map_round_trip() {
    let map = bytes_to_unicode();
    let inv = unicode_to_bytes_table(&map);
    let mut seen = std::collections::HashSet::new();
    for b in 0..=255u8 {
        let c = map[b as usize];
        assert!(seen.insert(c), "byte map not injective at {b}");
        assert_eq!(inv[c as usize], Some(b));
        if (0x21..=0x7E).contains(&b) {
            assert_eq!(c, b as char);
        }
    }
    assert_eq!(map[b' ' as usize], 'Ġ');
    assert_eq!(map[b'\n' as usize], 'Ċ');
    let all: Vec<u8> = (0..=255).collect();
    let encoded: String = all.iter().map(|&b| map[b as usize]).collect();
    assert_eq!(decode_byte_level(&encoded, &inv), all);
    // a character outside the map is reported like llama.cpp does
    assert_eq!(
        decode_byte_level("€", &inv),
        b"[UNK_BYTE_0xe282ac\xe2\x82\xac]".to_vec()
    );
    // ... with the token's text once, not once per unmapped char (quadratic in its length)
    assert_eq!(
        decode_byte_level("€a€", &inv),
        b"[UNK_BYTE_0xe282ac\xe2\x82\xaca\xe2\x82\xac]a[UNK_BYTE_0xe282ac]".to_vec()
    );
    let long = "\u{4e2d}".repeat(2000);
    assert!(decode_byte_level(&long, &inv).len() < 30 * long.len());
}

#[test]
fn tiny_vocab_merges_and_specials() {
    let tok = tiny("gpt2");
    let hello = tok.token_id("hello").unwrap();
    let world = tok.token_id("Ġworld").unwrap();
    assert_eq!(
        tok.encode("hello world", false).unwrap(),
        vec![hello, world]
    );
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let tool = tok.token_id("<tool>").unwrap();
    assert_eq!(
        tok.encode("<|im_start|>hello<|im_end|>", true).unwrap(),
        vec![im_start, hello, im_end]
    );
    // without special parsing control tokens are plain text; user-defined ones are not
    let plain = tok.encode("<|im_end|><tool>", false).unwrap();
    assert!(!plain.contains(&im_end));
    assert_eq!(plain.last(), Some(&tool));
    assert_eq!(tok.decode(&plain, false), "<|im_end|><tool>");
    // unused tokens are not special and render as nothing
    let pad = tok.token_id("[PAD0]").unwrap();
    assert_eq!(tok.encode("[PAD0]", true).unwrap().len(), 6);
    assert_eq!(tok.token_bytes(pad), Some(&b""[..]));
    // decode / skip_special
    let ids = [im_start, hello, world, im_end];
    assert_eq!(tok.decode(&ids, false), "<|im_start|>hello world<|im_end|>");
    assert_eq!(tok.decode(&ids, true), "hello world");
    assert_eq!(tok.decode(&[tool], true), "<tool>");
    // end of generation: eos + the text-detected ones
    assert!(tok.is_eog(im_end));
    assert!(tok.is_eog(tok.token_id("<|endoftext|>").unwrap()));
    assert!(!tok.is_eog(im_start) && !tok.is_eog(hello));
    assert!(tok.is_control(im_start) && !tok.is_control(tool) && !tok.is_control(hello));
    assert_eq!(tok.bos_id(), Some(im_start));
    assert_eq!(tok.eos_id(), Some(im_end));
    assert_eq!(tok.encode_prompt("hello").unwrap(), vec![hello]);
    assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new());
}

#[test]
fn out_of_range_ids_do_not_panic() {
    let tok = tiny("smollm");
    let n = tok.vocab_size() as u32;
    for id in [n, n + 1, u32::MAX] {
        assert_eq!(tok.token_bytes(id), None);
        assert!(!tok.is_eog(id) && !tok.is_control(id));
        assert_eq!(tok.decode(&[id], false), "");
    }
    let mut sd = StreamDecoder::new(tok, false);
    assert_eq!(sd.push(u32::MAX), "");
}

#[test]
fn bad_metadata_is_an_error() {
    let mut m = tiny_meta("gpt2");
    m.insert(
        "tokenizer.ggml.pre".into(),
        MetaValue::Str("no-such-pre".into()),
    );
    assert!(matches!(
        Tokenizer::from_meta(&m),
        Err(EngineError::Tokenizer(_))
    ));
    let mut m = tiny_meta("gpt2");
    m.insert(
        "tokenizer.ggml.model".into(),
        MetaValue::Str("llama".into()),
    );
    assert!(matches!(
        Tokenizer::from_meta(&m),
        Err(EngineError::Tokenizer(_))
    ));
    let mut m = tiny_meta("gpt2");
    m.remove("tokenizer.ggml.merges");
    assert!(Tokenizer::from_meta(&m).is_err());
    let mut m = tiny_meta("gpt2");
    m.insert("tokenizer.ggml.tokens".into(), strs(&["a", "a"]));
    assert!(Tokenizer::from_meta(&m).is_err());
}

#[test]
fn stream_decoder_holds_back_split_emoji() {
    let tok = tiny("qwen2");
    let ids = tok.encode("a😀b", false).unwrap();
    // the emoji has no merged token: one token per byte
    assert_eq!(ids.len(), 6);
    let mut sd = StreamDecoder::new(tok, false);
    let outs: Vec<String> = ids.iter().map(|&id| sd.push(id)).collect();
    assert_eq!(outs, ["a", "", "", "", "😀", "b"]);
    assert_eq!(sd.finish(), "");

    // an incomplete sequence at the end is flushed lossily by finish()
    let mut sd = StreamDecoder::new(tok, false);
    assert_eq!(sd.push(ids[1]), "");
    assert_eq!(sd.push(ids[2]), "");
    assert_eq!(sd.pending_bytes(), 2);
    assert_eq!(sd.finish(), "\u{FFFD}");

    // a byte that can never start a sequence is replaced at once
    let cont = tok.token_id(&tok.byte_chars[0x80].to_string()).unwrap();
    let mut sd = StreamDecoder::new(tok, false);
    assert_eq!(sd.push(cont), "\u{FFFD}");
    assert_eq!(sd.push(ids[0]), "a");
    // a lead byte followed by a non-continuation: replacement, then the new text
    let mut sd = StreamDecoder::new(tok, false);
    assert_eq!(sd.push(ids[1]), "");
    assert_eq!(sd.push(ids[0]), "\u{FFFD}a");

    // special tokens are skipped on request
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let mut sd = StreamDecoder::new(tok, true);
    assert_eq!(sd.push(im_end), "");
    let mut sd = StreamDecoder::new(tok, false);
    assert_eq!(sd.push(im_end), "<|im_end|>");
}

#[test]
fn chat_template_chatml_with_default_system() {
    assert_eq!(
        default_system_from_template(SMOL_TEMPLATE).as_deref(),
        Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    );
    assert_eq!(
        default_system_from_template(QWEN_TEMPLATE).as_deref(),
        Some("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    );
    assert_eq!(default_system_from_template("{{ messages }}"), None);

    let tok = tiny("smollm");
    let msgs = [
        ChatMessage::new("user", "Hi!"),
        ChatMessage::new("assistant", "Hello."),
    ];
    assert_eq!(
        tok.apply_chat_template(&msgs, true),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n"
    );
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi!"),
    ];
    assert_eq!(
        tok.apply_chat_template(&msgs, false),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    );
    // the rendered prompt tokenizes with the ChatML tokens
    let ids = tok
        .encode_prompt(&tok.apply_chat_template(&msgs, true))
        .unwrap();
    assert_eq!(ids[0], tok.token_id("<|im_start|>").unwrap());
}

/// Splits `text` with a pre-tokenizer step (scanner) — the words as strings.
fn scan_split(tok: &Tokenizer, text: &str) -> Vec<String> {
    tok.split_words(text)
        .unwrap()
        .into_iter()
        .map(|(s, e)| text[s..e].to_string())
        .collect()
}

/// The same with fancy-regex running the pattern (matches and the gaps between them).
fn regex_split(patterns: &[&str], text: &str) -> Vec<String> {
    static CACHE: std::sync::Mutex<Vec<(String, &'static Regex)>> =
        std::sync::Mutex::new(Vec::new());
    let mut pieces = vec![text.to_string()];
    for p in patterns {
        let re: &'static Regex = {
            let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
            match cache.iter().find(|(q, _)| q == p) {
                Some((_, r)) => r,
                None => {
                    let r: &'static Regex = Box::leak(Box::new(Regex::new(p).unwrap()));
                    cache.push((p.to_string(), r));
                    r
                }
            }
        };
        let mut next = Vec::new();
        for piece in &pieces {
            let mut last = 0;
            for m in re.find_iter(piece) {
                let m = m.unwrap();
                if m.start() > last {
                    next.push(piece[last..m.start()].to_string());
                }
                next.push(m.as_str().to_string());
                last = m.end();
            }
            if last < piece.len() {
                next.push(piece[last..].to_string());
            }
        }
        pieces = next;
    }
    pieces
}

fn arb_text() -> impl Strategy<Value = String> {
    let pool: Vec<char> = "aZé Ω字あ한 \t\n\r\x0b\u{a0}\u{3000}\u{85}\u{200b}0９²Ⅻ'sStTrReEvVmMlLdD.,!?-_😀\u{301}\u{fe0f}\u{200d}#<|>"
        .chars()
        .collect();
    proptest::collection::vec(proptest::sample::select(pool), 0..48)
        .prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn gpt2_matcher_equals_regex(text in arb_text()) {
        let tok = tiny("gpt2");
        prop_assert_eq!(scan_split(tok, &text), regex_split(&[RE_GPT2], &text));
    }

    #[test]
    fn smollm_matcher_equals_regex(text in arb_text()) {
        let tok = tiny("smollm");
        prop_assert_eq!(scan_split(tok, &text), regex_split(&[r"\p{N}", RE_GPT2], &text));
    }

    #[test]
    fn qwen2_matcher_equals_regex(text in arb_text()) {
        let tok = tiny("qwen2");
        prop_assert_eq!(scan_split(tok, &text), regex_split(&[RE_QWEN2], &text));
    }

    #[test]
    fn llama3_matcher_equals_regex(text in arb_text()) {
        let tok = tiny("llama-bpe");
        prop_assert_eq!(scan_split(tok, &text), regex_split(&[RE_LLAMA3], &text));
    }

    #[test]
    fn encode_decode_round_trip(text in arb_text()) {
        let tok = tiny("qwen2");
        let ids = tok.encode(&text, false).unwrap();
        prop_assert_eq!(tok.decode(&ids, false), text.clone());
        let mut sd = StreamDecoder::new(tok, false);
        let mut out: String = ids.iter().map(|&id| sd.push(id)).collect();
        out.push_str(&sd.finish());
        prop_assert_eq!(out, text);
    }
}

#[test]
fn long_whitespace_runs_split() {
    // far beyond what a backtracking regex engine can hold on its stack
    let tok = tiny("qwen2");
    let text = format!("a{}b\n{}", " ".repeat(300_000), "\n".repeat(300_000));
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(tok.decode(&ids, false), text);
}
