//! Pre-tokenizer of the byte-level BPE: llama.cpp's per-`tokenizer.ggml.pre` split patterns.

use fancy_regex::{Regex, RegexBuilder};

use super::tok_err;
use crate::error::Result;

// Pre-tokenizer split patterns (llama.cpp's `llm_tokenizer_bpe` constructor). The three
// patterns with look-ahead are run by hand-written matchers with exactly these semantics
// (llama.cpp, too, has hand-written matchers for GPT-2 and LLaMA-3): fancy-regex's
// backtracking VM caps its stack at 1M entries and errors out on long whitespace runs
// (1M spaces fail). The unit tests check the matchers against fancy-regex running these
// patterns on random text. llama.cpp's GPT-2 matcher has the trailing `\s+` alternative.
#[allow(dead_code)] // the oracle of the matcher tests
pub(super) const RE_GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
#[allow(dead_code)]
pub(super) const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
#[allow(dead_code)]
pub(super) const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One pre-tokenizer split step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SplitKind {
    /// A look-ahead-free regex, run by fancy-regex (delegated to regex-automata).
    Regex(&'static str),
    /// `RE_GPT2`.
    Gpt2,
    /// `RE_LLAMA3` (`digits = 3`) or `RE_QWEN2` (`digits = 1`).
    Llama3 { digits: usize },
}

pub(super) enum Split {
    Regex(Regex),
    Gpt2,
    Llama3 { digits: usize },
}

/// Character classes of the split patterns, computed per text with fancy-regex's Unicode
/// tables: `\p{L}`, `\p{N}`, `\s`.
pub(super) struct Classes {
    letter: Regex,
    number: Regex,
    space: Regex,
}

const F_LETTER: u8 = 1;
const F_NUMBER: u8 = 2;
const F_SPACE: u8 = 4;

impl Classes {
    pub(super) fn new() -> Result<Self> {
        Ok(Classes {
            letter: build_regex(r"\p{L}+")?,
            number: build_regex(r"\p{N}+")?,
            space: build_regex(r"\s+")?,
        })
    }

    /// Flags of every character of `text`, indexed by the byte offset of its first byte.
    fn flags(&self, text: &str) -> Result<Vec<u8>> {
        let mut flags = vec![0u8; text.len()];
        for (re, bit) in [
            (&self.letter, F_LETTER),
            (&self.number, F_NUMBER),
            (&self.space, F_SPACE),
        ] {
            for m in re.find_iter(text) {
                let m = m.map_err(|e| tok_err(format!("character classes: {e}")))?;
                for f in &mut flags[m.start()..m.end()] {
                    *f |= bit;
                }
            }
        }
        Ok(flags)
    }
}

/// Cursor over the characters of one piece `[start, end)` of a text; positions outside the
/// piece read as "no character" (flags 0), like llama.cpp's `OUT_OF_RANGE`.
struct Scan<'a> {
    text: &'a str,
    flags: &'a [u8],
    end: usize,
}

impl Scan<'_> {
    fn char_at(&self, pos: usize) -> Option<char> {
        if pos < self.end {
            self.text.get(pos..).and_then(|t| t.chars().next())
        } else {
            None
        }
    }
    fn flags_at(&self, pos: usize) -> u8 {
        if pos < self.end {
            self.flags[pos]
        } else {
            0
        }
    }
    fn next_pos(&self, pos: usize) -> usize {
        pos + self.char_at(pos).map_or(1, char::len_utf8)
    }
    /// In range and not `\s`, `\p{L}`, `\p{N}` (the class `[^\s\p{L}\p{N}]`).
    fn is_other(&self, pos: usize) -> bool {
        pos < self.end && self.flags[pos] == 0
    }
    /// `'s|'t|'re|'ve|'m|'ll|'d` at `pos` (ASCII case-insensitive if `fold`): end of the match.
    fn contraction(&self, pos: usize, fold: bool) -> Option<usize> {
        if self.char_at(pos) != Some('\'') {
            return None;
        }
        let norm = |c: Option<char>| c.map(|c| if fold { c.to_ascii_lowercase() } else { c });
        let c1 = norm(self.char_at(pos + 1))?;
        if !c1.is_ascii() {
            return None;
        }
        if matches!(c1, 's' | 't' | 'm' | 'd') {
            return Some(pos + 2);
        }
        let c2 = norm(self.char_at(pos + 2))?;
        if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
            return Some(pos + 3);
        }
        None
    }
    /// End of the run of characters with `bit` starting at `pos`.
    fn run(&self, mut pos: usize, bit: u8) -> usize {
        while self.flags_at(pos) & bit != 0 {
            pos = self.next_pos(pos);
        }
        pos
    }
    fn run_other(&self, mut pos: usize) -> usize {
        while self.is_other(pos) {
            pos = self.next_pos(pos);
        }
        pos
    }
    /// Whitespace at `pos`: (end of the run, end of its last `\r`/`\n` if any).
    fn space_run(&self, mut pos: usize) -> (usize, Option<usize>) {
        let mut last_nl = None;
        while self.flags_at(pos) & F_SPACE != 0 {
            let c = self.char_at(pos);
            pos = self.next_pos(pos);
            if matches!(c, Some('\r' | '\n')) {
                last_nl = Some(pos);
            }
        }
        (pos, last_nl)
    }
    /// `\s+(?!\S)|\s+` at `pos` (which is whitespace): end of the match.
    fn trailing_space(&self, pos: usize, run_end: usize) -> usize {
        if run_end < self.end {
            // followed by a non-space: give the last whitespace character back
            let mut last = pos;
            let mut p = pos;
            while p < run_end {
                last = p;
                p = self.next_pos(p);
            }
            if last > pos {
                return last;
            }
        }
        run_end
    }

    /// One match of `RE_GPT2` at `pos`; returns its end.
    fn gpt2(&self, pos: usize) -> usize {
        if let Some(e) = self.contraction(pos, false) {
            return e;
        }
        let c = self.char_at(pos);
        let body = if c == Some(' ') {
            self.next_pos(pos)
        } else {
            pos
        };
        let f2 = self.flags_at(body);
        if f2 & F_LETTER != 0 {
            return self.run(body, F_LETTER);
        }
        if f2 & F_NUMBER != 0 {
            return self.run(body, F_NUMBER);
        }
        if self.is_other(body) {
            return self.run_other(body);
        }
        let (run_end, _) = self.space_run(pos);
        if run_end > pos {
            return self.trailing_space(pos, run_end);
        }
        self.next_pos(pos)
    }

    /// One match of `RE_LLAMA3` / `RE_QWEN2` at `pos`; returns its end.
    fn llama3(&self, pos: usize, digits: usize) -> usize {
        if let Some(e) = self.contraction(pos, true) {
            return e;
        }
        let c = self.char_at(pos);
        let f = self.flags_at(pos);
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !matches!(c, Some('\r' | '\n')) && f & F_NUMBER == 0 {
            let next = self.next_pos(pos);
            if f & F_LETTER != 0 || self.flags_at(next) & F_LETTER != 0 {
                return self.run(next, F_LETTER);
            }
        }
        // \p{N}{1,digits}
        if f & F_NUMBER != 0 {
            let mut p = pos;
            for _ in 0..digits {
                if self.flags_at(p) & F_NUMBER == 0 {
                    break;
                }
                p = self.next_pos(p);
            }
            return p;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let body = if c == Some(' ') {
            self.next_pos(pos)
        } else {
            pos
        };
        if self.is_other(body) {
            let mut p = self.run_other(body);
            while matches!(self.char_at(p), Some('\r' | '\n')) {
                p += 1;
            }
            return p;
        }
        // \s*[\r\n]+ | \s+(?!\S) | \s+
        let (run_end, last_nl) = self.space_run(pos);
        if let Some(nl) = last_nl {
            return nl;
        }
        if run_end > pos {
            return self.trailing_space(pos, run_end);
        }
        self.next_pos(pos)
    }
}

pub(super) fn build_regex(pattern: &str) -> Result<Regex> {
    RegexBuilder::new(pattern)
        .build()
        .map_err(|e| tok_err(format!("bad pre-tokenizer regex {pattern:?}: {e}")))
}

/// Pre-tokenizer steps and flags for a `tokenizer.ggml.pre` value.
/// Returns (steps, ignore_merges, default add_bos).
pub(super) fn pre_config(pre: &str) -> Result<(Vec<SplitKind>, bool, bool)> {
    use SplitKind::*;
    const LLAMA3: SplitKind = Llama3 { digits: 3 };
    const QWEN2: SplitKind = Llama3 { digits: 1 };
    Ok(match pre {
        "" | "default" => (
            vec![
                Regex(r"[\p{P}\$\+<=>\^~\|]+"),
                Gpt2,
                Regex(r"\p{N}+"),
                Regex(r"[0-9][0-9][0-9]"),
            ],
            false,
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => (vec![LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => (vec![LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" | "hunyuan" => (vec![QWEN2], false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec![Regex(r"\p{N}"), Gpt2], false, false)
        }
        "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" => (vec![Gpt2], false, false),
        other => {
            return Err(tok_err(format!(
                "unsupported pre-tokenizer '{other}' (supported: smollm, qwen2, llama-bpe, gpt-2, default and their llama.cpp aliases)"
            )))
        }
    })
}

/// Pre-tokenizes `text` (no special tokens) into words, as byte ranges of `text`. Each
/// step splits every piece of the previous one; text between matches is a piece too.
pub(super) fn split_words(
    splits: &[Split],
    classes: &Classes,
    text: &str,
) -> Result<Vec<(usize, usize)>> {
    let mut pieces = vec![(0, text.len())];
    let mut flags = None;
    for split in splits {
        let mut next = Vec::with_capacity(pieces.len() * 2);
        for &(s, e) in &pieces {
            match split {
                Split::Regex(re) => {
                    let mut last = s;
                    for m in re.find_iter(&text[s..e]) {
                        let m = m.map_err(|err| tok_err(format!("pre-tokenizer regex: {err}")))?;
                        let (ms, me) = (s + m.start(), s + m.end());
                        if ms > last {
                            next.push((last, ms));
                        }
                        if me > ms {
                            next.push((ms, me));
                        }
                        last = me;
                    }
                    if last < e {
                        next.push((last, e));
                    }
                }
                Split::Gpt2 | Split::Llama3 { .. } => {
                    if flags.is_none() {
                        flags = Some(classes.flags(text)?);
                    }
                    let scan = Scan {
                        text,
                        flags: flags.as_deref().unwrap_or_default(),
                        end: e,
                    };
                    let mut pos = s;
                    while pos < e {
                        let end = match split {
                            Split::Llama3 { digits } => scan.llama3(pos, *digits),
                            _ => scan.gpt2(pos),
                        };
                        // never stall, never cut a character, never leave the piece
                        let end = if end > pos {
                            end.min(e)
                        } else {
                            scan.next_pos(pos).min(e)
                        };
                        next.push((pos, end));
                        pos = end;
                    }
                }
            }
        }
        pieces = next;
    }
    Ok(pieces)
}
