//! Exact comparison of Arbor's tokenizer with llama.cpp (fixtures from `scripts/gen_fixtures.py`).
//!
//! Needs `smollm2-135m` and `qwen2.5-coder-0.5b` (the Qwen2.5-Coder tokenizer) in
//! `$ARBOR_HOME/models` (default `~/.cache/arbor/models`); they are fetched if missing, and a
//! model that cannot be had fails the test with the command that fetches it.

use std::path::{Path, PathBuf};

use arbor_engine::gguf::GgufFile;
use arbor_engine::tokenizer::{StreamDecoder, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct TokenizeFixture {
    model: String,
    llama_cpp_python: String,
    n_vocab: usize,
    bos: u32,
    eos: u32,
    eog_ids: Vec<u32>,
    control_ids: Vec<u32>,
    pieces_hex: Vec<(u32, String)>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_plain: Vec<u32>,
    detok_hex: String,
    detok_plain_hex: String,
}

#[derive(Deserialize)]
struct GreedyFixture {
    model: String,
    prompts: Vec<GreedyPrompt>,
}

#[derive(Deserialize)]
struct GreedyPrompt {
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

/// The Qwen2.5-Coder tokenizer is the same in the 0.5b and 1.5b files; the tests use the 0.5b.
const QWEN_TOKENIZER: &str = "qwen2.5-coder-0.5b";

fn load_tokenizer(name: &str) -> Tokenizer {
    let name = name.trim_end_matches(".gguf");
    let path = arbor_tools::resolve_model(name).unwrap_or_else(|e| {
        panic!("model {name} is not available ({e}): run `arbor models fetch {name}` first (ARBOR_HOME={:?})",
            std::env::var_os("ARBOR_HOME"))
    });
    let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("tokenizer of {}: {e}", path.display()))
}

fn read_json<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = fixtures_dir().join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn check_tokenize(fixture_name: &str) {
    let fx: TokenizeFixture = read_json(fixture_name);
    let tok = load_tokenizer(&fx.model);
    let mut failures: Vec<String> = Vec::new();
    let mut no_round_trip = 0;

    assert_eq!(tok.vocab_size(), fx.n_vocab, "vocab size");
    assert_eq!(tok.bos_id(), Some(fx.bos), "bos");
    assert_eq!(tok.eos_id(), Some(fx.eos), "eos");

    for id in 0..fx.n_vocab as u32 {
        let want_eog = fx.eog_ids.binary_search(&id).is_ok();
        if tok.is_eog(id) != want_eog {
            failures.push(format!(
                "is_eog({id}) = {}, llama.cpp says {want_eog}",
                tok.is_eog(id)
            ));
        }
        let want_control = fx.control_ids.binary_search(&id).is_ok();
        if tok.is_control(id) != want_control {
            failures.push(format!(
                "is_control({id}) = {}, llama.cpp says {want_control}",
                tok.is_control(id)
            ));
        }
    }
    for (id, hex) in &fx.pieces_hex {
        let want = unhex(hex);
        if tok.token_bytes(*id) != Some(want.as_slice()) {
            failures.push(format!(
                "token_bytes({id}) = {:?}, llama.cpp piece {:?}",
                tok.token_bytes(*id),
                want
            ));
        }
    }

    for case in &fx.cases {
        let text = &case.text;
        match tok.encode(text, true) {
            Ok(ids) if ids == case.ids => {}
            Ok(ids) => failures.push(format!(
                "encode({text:?}, special) = {ids:?}, llama.cpp {:?}",
                case.ids
            )),
            Err(e) => failures.push(format!("encode({text:?}, special) failed: {e}")),
        }
        match tok.encode(text, false) {
            Ok(ids) if ids == case.ids_plain => {}
            Ok(ids) => failures.push(format!(
                "encode({text:?}, plain) = {ids:?}, llama.cpp {:?}",
                case.ids_plain
            )),
            Err(e) => failures.push(format!("encode({text:?}, plain) failed: {e}")),
        }
        // detokenization of llama.cpp's ids, with and without special tokens
        let want = String::from_utf8_lossy(&unhex(&case.detok_hex)).into_owned();
        let got = tok.decode(&case.ids, false);
        if got != want {
            failures.push(format!(
                "decode({:?}) = {got:?}, llama.cpp {want:?}",
                case.ids
            ));
        }
        let want_plain = String::from_utf8_lossy(&unhex(&case.detok_plain_hex)).into_owned();
        let got_plain = tok.decode(&case.ids, true);
        if got_plain != want_plain {
            failures.push(format!(
                "decode({:?}, skip_special) = {got_plain:?}, llama.cpp {want_plain:?}",
                case.ids
            ));
        }
        // round trip, including through the streaming decoder, for the texts llama.cpp itself
        // round-trips (a byte with no token, e.g. U+001D in SmolLM2's vocab, is dropped)
        if want != *text {
            no_round_trip += 1;
            continue;
        }
        if let Ok(ids) = tok.encode(text, true) {
            let back = tok.decode(&ids, false);
            if &back != text {
                failures.push(format!("decode(encode({text:?})) = {back:?}"));
            }
            let mut sd = StreamDecoder::new(&tok, false);
            let mut streamed: String = ids.iter().map(|&id| sd.push(id)).collect();
            streamed.push_str(&sd.finish());
            if &streamed != text {
                failures.push(format!("StreamDecoder(encode({text:?})) = {streamed:?}"));
            }
        }
    }

    println!(
        "{fixture_name}: {} cases x 2 modes vs llama-cpp-python {}, {} without round trip, {} failures",
        fx.cases.len(),
        fx.llama_cpp_python,
        no_round_trip,
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} mismatches with llama.cpp in {fixture_name}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `tokenizer`: a model with the same tokenizer as the fixture's (`None`: the fixture's model).
fn check_greedy_prompts(fixture_name: &str, tokenizer: Option<&str>) {
    let fx: GreedyFixture = read_json(fixture_name);
    let tok = load_tokenizer(tokenizer.unwrap_or(&fx.model));
    for p in &fx.prompts {
        let ids = tok.encode(&p.prompt, true).expect("encode");
        assert_eq!(
            ids, p.prompt_ids,
            "prompt ids of {:?} ({fixture_name})",
            p.prompt
        );
        assert_eq!(
            tok.encode_prompt(&p.prompt).expect("encode_prompt"),
            p.prompt_ids
        );
        assert!(p
            .greedy_ids
            .iter()
            .all(|&id| (id as usize) < tok.vocab_size()));
    }
}

#[test]
fn smollm2_matches_llamacpp() {
    check_tokenize("tokenize_smollm2.json");
}

#[test]
fn qwen2_matches_llamacpp() {
    check_tokenize("tokenize_qwen2.json");
}

#[test]
fn greedy_prompt_ids_match_llamacpp() {
    check_greedy_prompts("greedy_smollm2.json", None);
    check_greedy_prompts("greedy_qwen15.json", Some(QWEN_TOKENIZER));
}

#[test]
fn chat_templates_default_system() {
    let smol = load_tokenizer("smollm2-135m");
    assert_eq!(
        smol.default_system_message(),
        Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    );
    let qwen = load_tokenizer(QWEN_TOKENIZER);
    assert_eq!(
        qwen.default_system_message(),
        Some("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    );
    let msgs = [arbor_engine::tokenizer::ChatMessage::new("user", "hi")];
    assert_eq!(
        qwen.apply_chat_template(&msgs, true),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}
