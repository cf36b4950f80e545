//! Byte-level BPE tokenizer (GPT-2 style: regex pre-tokenizer, byte↔unicode map, rank-ordered merges) built from GGUF metadata, matching llama.cpp's `llm_tokenizer_bpe`.
//!
//! What is reproduced from llama.cpp (`src/llama-vocab.cpp`, `src/unicode.cpp`):
//!
//! * token attributes from `tokenizer.ggml.token_type`, plus llama.cpp's text-based
//!   auto-detection of EOT / EOM / FIM tokens and of the end-of-generation (EOG) set
//!   (those tokens are forced to be control tokens, as llama.cpp does);
//! * special-token partitioning (`tokenizer_st_partition`): special tokens (control,
//!   user-defined, unknown) are cut out of the text longest-first before pre-tokenization;
//!   with `parse_special = false` only user-defined tokens are cut out;
//! * the per-`tokenizer.ggml.pre` split patterns (`pretok.rs`; applied in sequence, each on
//!   the pieces left by the previous one; text between matches becomes a piece of its own).
//!   Supported: `smollm`, `qwen2`, `llama-bpe`/`llama3`, `gpt-2`, `default` and the other
//!   names llama.cpp maps to the same patterns; anything else is an `EngineError::Tokenizer`;
//! * merges applied lowest rank first, ties broken leftmost, on the byte-encoded word;
//!   symbols that end up outside the vocabulary fall back to single-byte tokens;
//! * `token_to_piece`: normal tokens are byte-decoded, control / user-defined / unknown
//!   tokens yield their raw text (control and unknown ones only when special tokens are
//!   rendered), unused and undefined tokens yield nothing.
//!
//! Known differences: the Unicode tables are regex-syntax's (Unicode 16) rather than
//! llama.cpp's generated table, so code points assigned or re-categorised in recent Unicode
//! versions may split differently; per-model LSTRIP/RSTRIP attributes (phi-3, jina,
//! modern-bert) are not applied; `decode` does not perform `clean_up_tokenization_spaces`
//! (llama.cpp does not either for `smollm` and `qwen2`).
//!
//! Out-of-range ids never panic: `decode` and [`StreamDecoder`] skip them, `token_bytes`
//! returns `None`, `is_eog` / `is_control` return false.

use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, MetaValue};
use crate::sample::json::JsonVocab;
use crate::shared::Shared;

mod pretok;
#[cfg(test)]
mod tests;

use pretok::{build_regex, pre_config, Classes, Split, SplitKind};

// llama.cpp `llama_token_attr` bits.
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;

// Text-based special-token detection, as in the llama.cpp bundled with llama-cpp-python
// 0.3.16 (the reference of tests/fixtures). Newer llama.cpp versions extend these lists
// (e.g. `</s>`, `[EOS]`, `<eos>` as end-of-generation), which changes how such texts
// tokenize (they become control tokens); we stay with the reference.

/// Texts llama.cpp treats as end-of-generation tokens (and forces to control type).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// One chat message for [`Tokenizer::apply_chat_template`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A byte-level BPE tokenizer loaded from a GGUF file. Cheap to share (`Send + Sync`).
pub struct Tokenizer {
    pre: String,
    /// Token texts exactly as stored in the GGUF (byte-level encoded for normal tokens).
    texts: Vec<String>,
    /// `token_to_piece(id, special = true)` of every token.
    pieces: Vec<Vec<u8>>,
    attrs: Vec<u16>,
    text_to_id: HashMap<String, u32>,
    /// Interned strings of the merge table (merge sides and merge results).
    sym_ids: HashMap<String, u32>,
    /// (left symbol, right symbol) → (rank, merged symbol).
    merges: HashMap<(u32, u32), (u32, u32)>,
    splits: Vec<Split>,
    classes: Classes,
    ignore_merges: bool,
    /// Control / user-defined / unknown tokens, longest text first.
    special_tokens: Vec<u32>,
    eog: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
    default_system: Option<String>,
    byte_chars: [char; 256],
    /// The vocabulary as JSON mode reads it, built on first use.
    json_vocab: OnceLock<Arc<JsonVocab>>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("pre", &self.pre)
            .field("vocab_size", &self.texts.len())
            .field("n_merges", &self.merges.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

pub(crate) fn tok_err(msg: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(msg.into())
}

/// GPT-2's byte → printable character map.
fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut assigned = [false; 256];
    for b in (0x21..=0x7Eu32).chain(0xA1..=0xAC).chain(0xAE..=0xFF) {
        map[b as usize] = char::from_u32(b).unwrap_or('\0');
        assigned[b as usize] = true;
    }
    let mut n = 0u32;
    for b in 0..256usize {
        if !assigned[b] {
            map[b] = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
        }
    }
    map
}

/// Inverse of [`bytes_to_unicode`], indexed by code point (all mapped chars are < 324).
fn unicode_to_bytes_table(map: &[char; 256]) -> [Option<u8>; 324] {
    let mut inv = [None; 324];
    for (b, &c) in map.iter().enumerate() {
        if let Some(slot) = inv.get_mut(c as usize) {
            *slot = Some(b as u8);
        }
    }
    inv
}

/// llama.cpp `llama_decode_text`: byte-level text → raw bytes. A char outside the byte map
/// becomes `[UNK_BYTE_0x<hex>` + the token's text + `]` like llama.cpp's, except that the text
/// is appended for the first such char only (llama.cpp repeats it for each, which makes a long
/// token of unmapped chars cost memory quadratic in its length).
fn decode_byte_level(text: &str, inv: &[Option<u8>; 324]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut text_shown = false;
    for c in text.chars() {
        match inv.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                if !text_shown {
                    out.extend_from_slice(text.as_bytes());
                    text_shown = true;
                }
                out.push(b']');
            }
        }
    }
    out
}

/// Extracts the default system message of a ChatML template: the literal text in
/// `'<|im_start|>system\n…<|im_end|>'` (no expressions inside).
fn default_system_from_template(template: &str) -> Option<String> {
    const START: &str = "<|im_start|>system";
    const END: &str = "<|im_end|>";
    let mut from = 0;
    while let Some(pos) = template[from..].find(START) {
        let after = from + pos + START.len();
        from = after;
        let rest = &template[after..];
        let body = if let Some(r) = rest.strip_prefix('\n') {
            r
        } else if let Some(r) = rest.strip_prefix("\\n") {
            r
        } else {
            continue;
        };
        let Some(end) = body.find(END) else {
            continue;
        };
        let literal = &body[..end];
        if literal.is_empty() || literal.contains(['\'', '"', '{', '}', '+']) {
            continue;
        }
        return Some(
            literal
                .replace("\\n", "\n")
                .replace("\\t", "\t")
                .replace("\\\\", "\\"),
        );
    }
    None
}

/// Metadata lookup used by the constructor (a GGUF file, or a map in tests).
trait Meta {
    fn meta(&self, key: &str) -> Option<&MetaValue>;
}

impl Meta for GgufFile {
    fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.get(key)
    }
}

impl Meta for HashMap<String, MetaValue> {
    fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.get(key)
    }
}

fn meta_str_array<'a>(m: &'a dyn Meta, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(v) = m.meta(key) else {
        return Ok(None);
    };
    let arr = v
        .as_array()
        .ok_or_else(|| tok_err(format!("{key} is not an array")))?;
    arr.iter()
        .map(|x| {
            x.as_str()
                .ok_or_else(|| tok_err(format!("{key} has a non-string element")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// One fragment of the text after special-token partitioning.
#[derive(Clone, Copy)]
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: usize,
    next: usize,
    sym: u32,
}

const NONE: usize = usize::MAX;
const NO_SYM: u32 = u32::MAX;

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata. Only `tokenizer.ggml.model = gpt2`
    /// (byte-level BPE) is supported; an unknown `tokenizer.ggml.pre` is an error.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
        Self::from_meta(gguf)
    }

    fn from_meta(m: &dyn Meta) -> Result<Tokenizer> {
        let model = m
            .meta("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .ok_or_else(|| tok_err("missing tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(tok_err(format!(
                "unsupported tokenizer model '{model}' (only 'gpt2' byte-level BPE is supported)"
            )));
        }
        let pre = m
            .meta("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default")
            .to_string();
        let (steps, ignore_merges, mut add_bos) = pre_config(&pre)?;
        let splits = steps
            .into_iter()
            .map(|k| {
                Ok(match k {
                    SplitKind::Regex(p) => Split::Regex(build_regex(p)?),
                    SplitKind::Gpt2 => Split::Gpt2,
                    SplitKind::Llama3 { digits } => Split::Llama3 { digits },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let classes = Classes::new()?;

        let texts: Vec<String> = meta_str_array(m, "tokenizer.ggml.tokens")?
            .ok_or_else(|| tok_err("missing tokenizer.ggml.tokens"))?
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.to_string()
                }
            })
            .collect();
        let n = texts.len();
        if n == 0 || n > u32::MAX as usize / 2 {
            return Err(tok_err(format!("bad vocabulary size {n}")));
        }

        let mut text_to_id = HashMap::with_capacity(n);
        for (i, t) in texts.iter().enumerate() {
            if text_to_id.insert(t.clone(), i as u32).is_some() {
                return Err(tok_err(format!("duplicate token in vocabulary: {t:?}")));
            }
        }

        // token attributes
        let mut attrs = vec![ATTR_NORMAL; n];
        if let Some(types) = m.meta("tokenizer.ggml.token_type") {
            let types = types
                .as_array()
                .ok_or_else(|| tok_err("tokenizer.ggml.token_type is not an array"))?;
            if types.len() < n {
                return Err(tok_err(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    types.len()
                )));
            }
            for (a, t) in attrs.iter_mut().zip(types) {
                *a = match t.as_i64() {
                    Some(1) => ATTR_NORMAL,
                    Some(2) => ATTR_UNKNOWN,
                    Some(3) => ATTR_CONTROL,
                    Some(4) => ATTR_USER_DEFINED,
                    Some(5) => ATTR_UNUSED,
                    Some(6) => ATTR_BYTE,
                    _ => 0,
                };
            }
        }

        // merges
        let mut sym_ids: HashMap<String, u32> = HashMap::new();
        let mut merges: HashMap<(u32, u32), (u32, u32)> = HashMap::new();
        let merge_list = meta_str_array(m, "tokenizer.ggml.merges")?
            .ok_or_else(|| tok_err("missing tokenizer.ggml.merges"))?;
        let intern = |s: &str, sym_ids: &mut HashMap<String, u32>| -> u32 {
            if let Some(&id) = sym_ids.get(s) {
                return id;
            }
            let id = sym_ids.len() as u32;
            sym_ids.insert(s.to_string(), id);
            id
        };
        for (rank, line) in merge_list.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte
            let first = line.chars().next().map_or(0, char::len_utf8);
            let Some(pos) = line[first..].find(' ').map(|p| p + first) else {
                continue;
            };
            let (left, right) = (&line[..pos], &line[pos + 1..]);
            if left.is_empty() || right.is_empty() {
                continue;
            }
            let l = intern(left, &mut sym_ids);
            let r = intern(right, &mut sym_ids);
            let merged = intern(&format!("{left}{right}"), &mut sym_ids);
            merges.entry((l, r)).or_insert((rank as u32, merged));
        }

        // special token ids
        let id_in_range = |v: u64| (v < n as u64).then_some(v as u32);
        let get_id = |key: &str| -> Option<Option<u32>> {
            m.meta(key).and_then(|v| v.as_u64()).map(id_in_range)
        };
        let special = |key: &str, default: Option<u32>| -> Option<u32> {
            let default = default.filter(|&d| (d as usize) < n);
            match get_id(key) {
                Some(Some(id)) => Some(id),
                _ => default,
            }
        };
        let bos = special("tokenizer.ggml.bos_token_id", Some(11));
        let eos = special("tokenizer.ggml.eos_token_id", Some(11));
        let mut eot = special("tokenizer.ggml.eot_token_id", None);
        let mut eom = special("tokenizer.ggml.eom_token_id", None);
        let mut fim_pre = special("tokenizer.ggml.fim_pre_token_id", None)
            .or_else(|| special("tokenizer.ggml.prefix_token_id", None));
        let mut fim_suf = special("tokenizer.ggml.fim_suf_token_id", None)
            .or_else(|| special("tokenizer.ggml.suffix_token_id", None));
        let mut fim_mid = special("tokenizer.ggml.fim_mid_token_id", None)
            .or_else(|| special("tokenizer.ggml.middle_token_id", None));
        let mut fim_pad = special("tokenizer.ggml.fim_pad_token_id", None);
        let mut fim_rep = special("tokenizer.ggml.fim_rep_token_id", None);
        let mut fim_sep = special("tokenizer.ggml.fim_sep_token_id", None);

        if let Some(b) = m
            .meta("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
        {
            add_bos = b;
        }
        let add_eos = m
            .meta("tokenizer.ggml.add_eos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(tok_err(
                "tokenizer.ggml.add_bos_token is true, but there is no BOS token",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(tok_err(
                "tokenizer.ggml.add_eos_token is true, but there is no EOS token",
            ));
        }

        // llama.cpp's text-based auto-detection (it walks a hash map, so with several
        // candidates its choice is arbitrary; we take the lowest id).
        let find_first = |cands: &[&str]| -> Option<u32> {
            cands
                .iter()
                .filter_map(|t| text_to_id.get(*t).copied())
                .min()
        };
        for (slot, cands) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                if let Some(id) = find_first(cands) {
                    *slot = Some(id);
                    attrs[id as usize] |= ATTR_CONTROL;
                }
            }
        }

        // control tokens named "unused" are unused
        for (t, a) in texts.iter().zip(attrs.iter_mut()) {
            if *a & ATTR_CONTROL != 0 && t.contains("unused") {
                *a |= ATTR_UNUSED;
            }
        }

        // end-of-generation set
        let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for t in EOG_TEXTS {
            if let Some(&id) = text_to_id.get(*t) {
                eog.push(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = text_to_id.get(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        // gpt-oss: "<|end|>" ends a message, not the generation, when "<|return|>" and
        // "<|call|>" exist
        let eog_has = |eog: &[u32], t: &str| text_to_id.get(t).is_some_and(|id| eog.contains(id));
        if eog_has(&eog, "<|return|>") && eog_has(&eog, "<|call|>") && eog_has(&eog, "<|end|>") {
            let end = text_to_id["<|end|>"];
            eog.retain(|&x| x != end);
            attrs[end as usize] = ATTR_USER_DEFINED;
        }

        // special tokens, longest text first
        let mut special_tokens: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        special_tokens.sort_by(|&a, &b| {
            texts[b as usize]
                .len()
                .cmp(&texts[a as usize].len())
                .then(a.cmp(&b))
        });

        // pieces (token_to_piece with special = true)
        let byte_chars = bytes_to_unicode();
        let inv = unicode_to_bytes_table(&byte_chars);
        let pieces = texts
            .iter()
            .zip(&attrs)
            .map(|(t, &a)| {
                if a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
                    t.as_bytes().to_vec()
                } else if a & ATTR_NORMAL != 0 {
                    decode_byte_level(t, &inv)
                } else if a & ATTR_BYTE != 0 {
                    // "<0xXX>"
                    t.get(3..5)
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                        .map(|b| vec![b])
                        .unwrap_or_default()
                } else {
                    Vec::new()
                }
            })
            .collect();

        let chat_template = m
            .meta("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        let default_system = chat_template
            .as_deref()
            .and_then(default_system_from_template);

        Ok(Tokenizer {
            pre,
            texts,
            pieces,
            attrs,
            text_to_id,
            sym_ids,
            merges,
            splits,
            classes,
            ignore_merges,
            special_tokens,
            eog,
            bos,
            eos,
            eot,
            add_bos,
            add_eos,
            chat_template,
            default_system,
            byte_chars,
            json_vocab: OnceLock::new(),
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// The `tokenizer.ggml.pre` value this tokenizer was built for.
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre
    }

    /// Tokenizes `text` like `llama_tokenize(add_special = false, parse_special)`: never adds BOS.
    /// With `parse_special`, special-token text (e.g. `<|im_start|>`) becomes the special token;
    /// user-defined tokens are always matched.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for frag in self.partition_special(text, parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(s, e) => self.encode_raw(&text[s..e], &mut out)?,
            }
        }
        Ok(out)
    }

    /// Tokenizes a prompt like `llama_tokenize(add_special = true, parse_special = true)`:
    /// BOS first if the model asks for it (`tokenizer.ggml.add_bos_token`), EOS last if
    /// `tokenizer.ggml.add_eos_token`.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if self.add_bos {
            out.extend(self.bos);
        }
        out.extend(self.encode(text, true)?);
        if self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// The bytes `id` stands for (`token_to_piece` with special tokens rendered): normal
    /// tokens byte-decoded, control / user-defined tokens as their text, unused tokens empty.
    /// `None` for an out-of-range id.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// The bytes decoding `id` emits into generated text (`decode(.., skip_special = true)`):
    /// control and unknown tokens none.
    pub fn emitted_bytes(&self, id: u32) -> &[u8] {
        self.piece(id, true)
    }

    /// The token's text as stored in the model (byte-level encoded for normal tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// Id of a token given its stored text (e.g. `"<|im_end|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.text_to_id.get(text).copied()
    }

    fn piece(&self, id: u32, skip_special: bool) -> &[u8] {
        match self.pieces.get(id as usize) {
            Some(p) => {
                if skip_special && self.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                    &[]
                } else {
                    p
                }
            }
            None => &[],
        }
    }

    /// Concatenates the pieces of `ids` and converts to UTF-8 lossily at the very end.
    /// With `skip_special`, control and unknown tokens produce nothing (user-defined tokens
    /// are still rendered). Out-of-range ids are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece(id, skip_special));
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (metadata or auto-detected from its text).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// Whether `encode_prompt` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// llama.cpp's end-of-generation set: EOS, EOT, EOM, FIM pad/repo/file-sep and every
    /// token whose text is a known end marker (`<|im_end|>`, `<|endoftext|>`, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    /// The vocabulary as JSON mode ([`crate::sample::json`]) reads it, with the masks it has
    /// computed so far (built on first use, then shared).
    pub fn json_vocab(&self) -> Arc<JsonVocab> {
        Arc::clone(
            self.json_vocab
                .get_or_init(|| Arc::new(JsonVocab::from_tokenizer(self))),
        )
    }

    /// Whether `id` is a control token (after llama.cpp's attribute fix-ups).
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a & ATTR_CONTROL != 0)
    }

    /// The raw `tokenizer.chat_template` (Jinja), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The system message the chat template inserts when none is given.
    pub fn default_system_message(&self) -> Option<&str> {
        self.default_system.as_deref()
    }

    /// Renders messages in ChatML (`<|im_start|>{role}\n{content}<|im_end|>\n` each), with the
    /// template's default system message first when the first message is not a system one,
    /// and `<|im_start|>assistant\n` at the end if `add_generation_prompt`. Every model Arbor
    /// supports uses ChatML; other templates are rendered as ChatML too.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> String {
        let mut out = String::new();
        let first_is_system = messages.first().is_some_and(|m| m.role == "system");
        if !first_is_system {
            if let Some(sys) = &self.default_system {
                out.push_str("<|im_start|>system\n");
                out.push_str(sys);
                out.push_str("<|im_end|>\n");
            }
        }
        for m in messages {
            out.push_str("<|im_start|>");
            out.push_str(&m.role);
            out.push('\n');
            out.push_str(&m.content);
            out.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        out
    }

    /// llama.cpp `tokenizer_st_partition`: cut special tokens out of the text, longest first.
    fn partition_special(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0, text.len()));
        for &id in &self.special_tokens {
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let tok = self.texts[id as usize].as_str();
            if !text.contains(tok) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Token(_) => next.push(f),
                    Fragment::Text(mut s, e) => {
                        while let Some(p) = text[s..e].find(tok) {
                            if p > 0 {
                                next.push(Fragment::Text(s, s + p));
                            }
                            next.push(Fragment::Token(id));
                            s += p + tok.len();
                        }
                        if s < e {
                            next.push(Fragment::Text(s, e));
                        }
                    }
                }
            }
            frags = next;
        }
        frags
    }

    /// Pre-tokenizes `text` (no special tokens) into words, as byte ranges of `text`.
    fn split_words(&self, text: &str) -> Result<Vec<(usize, usize)>> {
        pretok::split_words(&self.splits, &self.classes, text)
    }

    /// Tokenizes text that contains no special tokens.
    fn encode_raw(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut word = String::new();
        for (s, e) in self.split_words(text)? {
            word.clear();
            for &b in &text.as_bytes()[s..e] {
                word.push(self.byte_chars[b as usize]);
            }
            if self.ignore_merges {
                if let Some(&id) = self.text_to_id.get(word.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            self.bpe_word(&word, out);
        }
        Ok(())
    }

    /// Applies the merges to one byte-encoded word (llama.cpp `llm_tokenizer_bpe_session`).
    fn bpe_word(&self, word: &str, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        let mut syms: Vec<Symbol> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            let end = start + c.len_utf8();
            syms.push(Symbol {
                start,
                end,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if end == word.len() { NONE } else { i + 1 },
                sym: self
                    .sym_ids
                    .get(&word[start..end])
                    .copied()
                    .unwrap_or(NO_SYM),
            });
        }

        // min-heap on (rank, left index)
        let mut heap: BinaryHeap<std::cmp::Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Symbol], l: usize| {
            if l == NONE {
                return;
            }
            let r = syms[l].next;
            if r == NONE {
                return;
            }
            let (a, b) = (syms[l].sym, syms[r].sym);
            if a == NO_SYM || b == NO_SYM {
                return;
            }
            if let Some(&(rank, _)) = self.merges.get(&(a, b)) {
                let size = syms[r].end - syms[l].start;
                heap.push(std::cmp::Reverse((rank, l, r, size)));
            }
        };
        for i in 0..syms.len() {
            push(&mut heap, &syms, i);
        }
        while let Some(std::cmp::Reverse((_, l, r, size))) = heap.pop() {
            let (ls, rs) = (syms[l], syms[r]);
            if ls.start == ls.end || rs.start == rs.end || ls.next != r || rs.end - ls.start != size
            {
                continue; // stale
            }
            let merged = self
                .merges
                .get(&(ls.sym, rs.sym))
                .map(|&(_, m)| m)
                .unwrap_or(NO_SYM);
            syms[l].end = rs.end;
            syms[l].next = rs.next;
            syms[l].sym = merged;
            syms[r].end = syms[r].start; // dead
            if rs.next != NONE {
                syms[rs.next].prev = l;
            }
            push(&mut heap, &syms, ls.prev);
            push(&mut heap, &syms, l);
        }

        let mut i = 0;
        while i != NONE {
            let s = syms[i];
            let text = &word[s.start..s.end];
            match self.text_to_id.get(text) {
                Some(&id) => out.push(id),
                None => {
                    // byte fallback: single-byte strings of the encoded text
                    for b in text.bytes().filter(u8::is_ascii) {
                        let one = [b];
                        let one = std::str::from_utf8(&one).unwrap_or_default();
                        if let Some(&id) = self.text_to_id.get(one) {
                            out.push(id);
                        }
                    }
                }
            }
            i = s.next;
        }
    }
}

/// Incremental detokenizer for streaming: never emits broken UTF-8. Bytes of an incomplete
/// UTF-8 sequence are held back until the following tokens complete it; bytes that can
/// never become valid are emitted as U+FFFD; `finish()` flushes the rest lossily.
pub struct StreamDecoder<'a> {
    tokenizer: Shared<'a, Tokenizer>,
    skip_special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: impl Into<Shared<'a, Tokenizer>>, skip_special: bool) -> Self {
        StreamDecoder {
            tokenizer: tokenizer.into(),
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending
            .extend_from_slice(self.tokenizer.piece(id, self.skip_special));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: the prefix is valid UTF-8 by construction
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            // incomplete sequence at the end: keep it for the next token
                            self.pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    /// Bytes held back waiting for the rest of a UTF-8 sequence.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Flushes what is left (an incomplete sequence becomes U+FFFD).
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
