//! JSON mode and JSON schemas (OpenAI's `response_format` `json_object` and `json_schema`): a byte-level pushdown automaton over RFC 8259 JSON, walking a compiled schema ([`crate::sample::schema`]), masks every token that cannot continue a valid text, as grammar-constrained decoding does (llama.cpp's GBNF sampler, vLLM's guided decoding).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::sample::schema::{
    JsonGrammar, Node, NodeId, Pattern, ANY, FREE_LITERALS, MAX_SCHEMA_DEPTH, UNBOUNDED,
};
use crate::tokenizer::Tokenizer;

/// Deepest nesting of free JSON's objects and arrays (the stack is one bit per level).
pub const MAX_DEPTH: u8 = 64;
/// Most whitespace bytes in a row between tokens of the JSON text (a model stuck on newlines
/// ends instead of filling `max_tokens` with them).
pub const MAX_WHITESPACE_RUN: u8 = 48;
/// Masks kept per vocabulary (one per grammar and automaton state met), in two generations of
/// half each.
const MASK_CACHE_ENTRIES: usize = 512;
/// Grammars named per vocabulary (by their digests) before the names start afresh.
const MAX_GRAMMAR_IDS: usize = 4096;

/// What the automaton expects next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mode {
    /// A value of this node (after whitespace).
    Expect(NodeId),
    /// Free JSON (inside an `any` node), after `{`: a key or `}`.
    ObjOpen,
    /// Free JSON, after `,` in an object: a key.
    ObjKey,
    /// Free JSON, after a key: `:`.
    Colon,
    /// Free JSON, after `[`: a value or `]`.
    ArrOpen,
    /// Free JSON, after a value inside a container: `,` or the container's closer.
    After,
    /// A schema object after `{` (`first`: `}` may come) or `,`: a key.
    SchemaKey {
        first: bool,
    },
    /// Inside a schema object's key: `cand`, the properties whose quoted name starts with the
    /// `pos` bytes read.
    Key {
        cand: u64,
        pos: u8,
    },
    /// After property `prop`'s key: `:`.
    SchemaColon {
        prop: u8,
    },
    /// A schema array after `[`: an item or `]`.
    SchemaArrOpen,
    /// After a value inside a schema container: `,` or the closer where the schema allows.
    SchemaAfter,
    /// Inside a string of `node` (a free key with `key`): `esc` 0 none, 1 after `\`, 2..=5 hex
    /// digits of `\u` left plus one; `utf8` continuation bytes of a multi-byte character left,
    /// the next one's range [`CONTINUATION`]`[first]` (no overlong forms, surrogates or code
    /// points past U+10FFFF); `len` characters read (counted only up to what the node's bounds
    /// tell apart); `dfa` the node's pattern's state (0 without one).
    Str {
        node: NodeId,
        key: bool,
        esc: u8,
        utf8: u8,
        first: u8,
        len: u16,
        dfa: u32,
    },
    Num {
        num: Num,
        integer: bool,
    },
    /// Inside one of `node`'s literal texts: `cand`, those starting with the `pos` bytes read.
    Lit {
        node: NodeId,
        cand: u64,
        pos: u8,
    },
    /// The top-level value is complete: whitespace, then end-of-generation.
    Done,
}

/// Where in a number (RFC 8259's `-? int frac? exp?`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

/// The ranges of a UTF-8 continuation byte: any; after E0; after ED; after F0; after F4
/// (RFC 3629's table).
const CONTINUATION: [(u8, u8); 5] = [
    (0x80, 0xBF),
    (0xA0, 0xBF),
    (0x80, 0x9F),
    (0x90, 0xBF),
    (0x80, 0x8F),
];

/// An open schema container: its node and the properties passed (objects) or items read
/// (arrays; counted only up to what the bounds tell apart).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Frame {
    node: NodeId,
    count: u16,
}

/// The automaton's state: small and `Copy`, so every token of the vocabulary is tried on a
/// copy. Read with the grammar it started from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JsonState {
    /// Open schema containers, innermost last (unused frames zeroed).
    frames: [Frame; MAX_SCHEMA_DEPTH],
    depth: u8,
    /// Free JSON nesting: bit `i` set where level `i` is an object (else an array).
    stack: u64,
    free_depth: u8,
    mode: Mode,
    /// Whitespace bytes just read.
    ws: u8,
}

/// Bits `0..n`.
fn all(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1 << n) - 1
    }
}

/// The indices of the set bits.
fn bits(mut w: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (w != 0).then(|| {
            let i = w.trailing_zeros() as usize;
            w &= w - 1;
            i
        })
    })
}

impl JsonState {
    /// Before the first byte of a text of `g`.
    pub fn start(g: &JsonGrammar) -> JsonState {
        JsonState {
            frames: [Frame::default(); MAX_SCHEMA_DEPTH],
            depth: 0,
            stack: 0,
            free_depth: 0,
            mode: Mode::Expect(g.root()),
            ws: 0,
        }
    }

    /// Whether the top-level value is complete.
    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// The state after `bytes`, or `None` where they leave the grammar.
    pub fn after(mut self, g: &JsonGrammar, bytes: &[u8]) -> Option<JsonState> {
        for &b in bytes {
            if !self.feed(g, b) {
                return None;
            }
        }
        Some(self)
    }

    /// Read one byte; false when it cannot continue the text (the state is then undefined).
    fn feed(&mut self, g: &JsonGrammar, b: u8) -> bool {
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match self.mode {
            Mode::Str {
                node,
                key,
                esc,
                utf8,
                first,
                len,
                dfa,
            } => self.string(g, b, node, key, esc, utf8, first, len, dfa),
            Mode::Num { num, integer } => self.number(g, b, num, integer),
            Mode::Lit { node, cand, pos } => self.literal(g, b, node, cand, pos),
            Mode::Key { cand, pos } => self.key(g, b, cand, pos),
            _ if ws => {
                self.ws += 1;
                self.ws <= MAX_WHITESPACE_RUN
            }
            mode => {
                self.ws = 0;
                match mode {
                    Mode::Expect(node) => self.start_value(g, node, b),
                    Mode::ObjOpen if b == b'}' => self.close_free(g, true),
                    Mode::ObjOpen | Mode::ObjKey => {
                        self.mode = Mode::Str {
                            node: ANY,
                            key: true,
                            esc: 0,
                            utf8: 0,
                            first: 0,
                            len: 0,
                            dfa: 0,
                        };
                        b == b'"'
                    }
                    Mode::Colon => {
                        self.mode = Mode::Expect(ANY);
                        b == b':'
                    }
                    Mode::ArrOpen if b == b']' => self.close_free(g, false),
                    Mode::ArrOpen => self.start_value(g, ANY, b),
                    Mode::After => {
                        let in_object = self.free_top_is_object();
                        match b {
                            b',' => {
                                self.mode = if in_object {
                                    Mode::ObjKey
                                } else {
                                    Mode::Expect(ANY)
                                };
                                true
                            }
                            b'}' => in_object && self.close_free(g, true),
                            b']' => !in_object && self.close_free(g, false),
                            _ => false,
                        }
                    }
                    Mode::SchemaKey { first } => {
                        let f = self.top();
                        if b == b'}' {
                            return first && g.may_close(f.node, f.count) && self.pop(g);
                        }
                        let cand = g.next_keys(f.node, f.count, self.depth);
                        self.mode = Mode::Key { cand, pos: 1 };
                        b == b'"' && cand != 0
                    }
                    Mode::SchemaColon { prop } => {
                        let f = self.top_mut();
                        f.count = prop as u16 + 1;
                        let node = f.node;
                        self.mode = Mode::Expect(g.props(node)[prop as usize].node);
                        b == b':'
                    }
                    Mode::SchemaArrOpen => {
                        let Some((items, min, max)) = g.array(self.top().node) else {
                            return false;
                        };
                        if b == b']' {
                            return min == 0 && self.pop(g);
                        }
                        max > 0 && self.start_value(g, items, b)
                    }
                    Mode::SchemaAfter => {
                        let f = self.top();
                        match (g.array(f.node), b) {
                            (Some((items, _, max)), b',') => {
                                self.mode = Mode::Expect(items);
                                (max == UNBOUNDED || f.count < max) && g.fits(items, self.depth)
                            }
                            (Some((_, min, _)), b']') => f.count >= min && self.pop(g),
                            (None, b',') => {
                                self.mode = Mode::SchemaKey { first: false };
                                g.next_keys(f.node, f.count, self.depth) != 0
                            }
                            (None, b'}') => g.may_close(f.node, f.count) && self.pop(g),
                            _ => false,
                        }
                    }
                    Mode::Done => false,
                    Mode::Str { .. } | Mode::Num { .. } | Mode::Lit { .. } | Mode::Key { .. } => {
                        unreachable!("handled above")
                    }
                }
            }
        }
    }

    fn top(&self) -> Frame {
        self.frames[(self.depth as usize).saturating_sub(1)]
    }

    fn top_mut(&mut self) -> &mut Frame {
        &mut self.frames[(self.depth as usize).saturating_sub(1)]
    }

    /// Open a schema container.
    fn push(&mut self, node: NodeId, mode: Mode) -> bool {
        if self.depth as usize >= MAX_SCHEMA_DEPTH {
            return false;
        }
        self.frames[self.depth as usize] = Frame { node, count: 0 };
        self.depth += 1;
        self.mode = mode;
        true
    }

    /// Close the innermost schema container (the caller checked the closer).
    fn pop(&mut self, g: &JsonGrammar) -> bool {
        if self.depth == 0 {
            return false;
        }
        self.depth -= 1;
        self.frames[self.depth as usize] = Frame::default();
        self.close_value(g);
        true
    }

    fn free_top_is_object(&self) -> bool {
        self.free_depth > 0 && self.stack >> (self.free_depth - 1) & 1 == 1
    }

    fn open_free(&mut self, object: bool) -> bool {
        if self.free_depth >= MAX_DEPTH {
            return false;
        }
        if object {
            self.stack |= 1 << self.free_depth;
        } else {
            self.stack &= !(1 << self.free_depth);
        }
        self.free_depth += 1;
        self.mode = if object { Mode::ObjOpen } else { Mode::ArrOpen };
        true
    }

    /// Close the innermost free container (the caller checked its kind).
    fn close_free(&mut self, g: &JsonGrammar, object: bool) -> bool {
        if self.free_depth == 0 || self.free_top_is_object() != object {
            return false;
        }
        self.free_depth -= 1;
        self.stack &= !(1 << self.free_depth);
        self.close_value(g);
        true
    }

    /// A value just ended: in free JSON, in a schema container (an array counts it), or at the
    /// top.
    fn close_value(&mut self, g: &JsonGrammar) {
        self.mode = if self.free_depth > 0 {
            Mode::After
        } else if self.depth == 0 {
            Mode::Done
        } else {
            let f = self.top_mut();
            if let Some((_, min, max)) = g.array(f.node) {
                // Counts past what the bounds tell apart are one state.
                let cap = if max == UNBOUNDED { min } else { max };
                f.count = f.count.saturating_add(1).min(cap);
            }
            Mode::SchemaAfter
        };
    }

    /// The first byte of a value of `node`, which must fit in the schema frames left (every
    /// state the automaton accepts can be completed).
    fn start_value(&mut self, g: &JsonGrammar, node: NodeId, b: u8) -> bool {
        if !g.fits(node, self.depth) {
            return false;
        }
        let string = Mode::Str {
            node,
            key: false,
            esc: 0,
            utf8: 0,
            first: 0,
            len: 0,
            dfa: 0,
        };
        let number = |integer| {
            match b {
                b'-' => Some(Num::Minus),
                b'0' => Some(Num::Zero),
                b'1'..=b'9' => Some(Num::Int),
                _ => None,
            }
            .map(|num| Mode::Num { num, integer })
        };
        self.mode = match g.node(node) {
            Node::Any => match b {
                b'{' => return self.open_free(true),
                b'[' => return self.open_free(false),
                b'"' => string,
                b't' | b'f' | b'n' => {
                    return self.literal(g, b, FREE_LITERALS, all(3), 0);
                }
                _ => match number(false) {
                    Some(m) => m,
                    None => return false,
                },
            },
            Node::AnyObject => return b == b'{' && self.open_free(true),
            Node::Object(_) => {
                return b == b'{' && self.push(node, Mode::SchemaKey { first: true })
            }
            Node::Array { .. } => return b == b'[' && self.push(node, Mode::SchemaArrOpen),
            Node::String { .. } if b == b'"' => string,
            Node::Number { integer } => match number(*integer) {
                Some(m) => m,
                None => return false,
            },
            Node::Literals(v) => return self.literal(g, b, node, all(v.len()), 0),
            Node::Union(opts) => {
                return g.pick(opts, b).is_some_and(|o| self.start_value(g, o, b));
            }
            Node::String { .. } | Node::Pending => return false,
        };
        true
    }

    /// One byte of one of `node`'s literal texts; a text that is complete while a longer one
    /// goes on (`1` and `12`) ends at the first byte that does not extend the other, which
    /// is then read in the container.
    fn literal(&mut self, g: &JsonGrammar, b: u8, node: NodeId, cand: u64, pos: u8) -> bool {
        let texts = g.literals(node);
        let (mut next, mut complete) = (0u64, false);
        for i in bits(cand) {
            match texts[i].get(pos as usize) {
                None => complete = true,
                Some(&c) if c == b => next |= 1 << i,
                Some(_) => {}
            }
        }
        if next == 0 {
            if complete {
                self.close_value(g);
                return self.feed(g, b);
            }
            return false;
        }
        let pos = pos + 1;
        if bits(next).all(|i| texts[i].len() == pos as usize) {
            self.close_value(g);
        } else {
            self.mode = Mode::Lit {
                node,
                cand: next,
                pos,
            };
        }
        true
    }

    /// One byte of a schema object's key (each name ends with its own quote: one completes).
    fn key(&mut self, g: &JsonGrammar, b: u8, cand: u64, pos: u8) -> bool {
        let props = g.props(self.top().node);
        let next = bits(cand)
            .filter(|&i| props[i].key.get(pos as usize) == Some(&b))
            .fold(0u64, |w, i| w | 1 << i);
        if next == 0 {
            return false;
        }
        let pos = pos + 1;
        self.mode = match bits(next).find(|&i| props[i].key.len() == pos as usize) {
            Some(prop) => Mode::SchemaColon { prop: prop as u8 },
            None => Mode::Key { cand: next, pos },
        };
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn string(
        &mut self,
        g: &JsonGrammar,
        b: u8,
        node: NodeId,
        key: bool,
        esc: u8,
        utf8: u8,
        first: u8,
        len: u16,
        dfa: u32,
    ) -> bool {
        let (min, max) = g.string_bounds(node);
        let pattern = g.pattern(node);
        // A pattern reads the string's raw bytes: every byte but the closing quote.
        let dfa = match pattern {
            Some(p) if b != b'"' || esc > 0 || utf8 > 0 => {
                let next = p.step(dfa, b);
                if next == Pattern::DEAD {
                    return false;
                }
                next
            }
            _ => dfa,
        };
        let set = |esc, utf8, first, len| Mode::Str {
            node,
            key,
            esc,
            utf8,
            first,
            len,
            dfa,
        };
        // A character starts: count it where the bounds tell counts apart.
        let counted = || {
            let cap = if max == UNBOUNDED { min } else { max };
            (max == UNBOUNDED || len < max).then(|| len.saturating_add(1).min(cap))
        };
        self.mode = if utf8 > 0 {
            let (lo, hi) = CONTINUATION[first as usize];
            if !(lo..=hi).contains(&b) {
                return false;
            }
            set(0, utf8 - 1, 0, len)
        } else if esc == 1 {
            match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => set(0, 0, 0, len),
                b'u' => set(5, 0, 0, len),
                _ => return false,
            }
        } else if esc > 1 {
            if !b.is_ascii_hexdigit() {
                return false;
            }
            set(if esc == 2 { 0 } else { esc - 1 }, 0, 0, len)
        } else {
            let (esc, utf8, first) = match b {
                b'"' if key => {
                    self.mode = Mode::Colon;
                    return true;
                }
                b'"' => {
                    if len < min || pattern.is_some_and(|p| !p.accepts(dfa)) {
                        return false;
                    }
                    self.close_value(g);
                    return true;
                }
                b'\\' => (1, 0, 0),
                0x00..=0x1F => return false,
                0x20..=0x7F => (0, 0, 0),
                0xC2..=0xDF => (0, 1, 0),
                0xE0 => (0, 2, 1),
                0xED => (0, 2, 2),
                0xE1..=0xEF => (0, 2, 0),
                0xF0 => (0, 3, 3),
                0xF4 => (0, 3, 4),
                0xF1..=0xF3 => (0, 3, 0),
                _ => return false,
            };
            let Some(len) = counted() else {
                return false;
            };
            set(esc, utf8, first, len)
        };
        true
    }

    fn number(&mut self, g: &JsonGrammar, b: u8, n: Num, integer: bool) -> bool {
        let digit = b.is_ascii_digit();
        let next = match (n, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, b'1'..=b'9') => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') if !integer => Num::Dot,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') if !integer => Num::Exp,
            (Num::Exp, b'+' | b'-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign | Num::ExpDigits, _) if digit => Num::ExpDigits,
            // A complete number ends at the first byte that cannot extend it, which is then
            // read in the container.
            (Num::Zero | Num::Int | Num::Frac | Num::ExpDigits, _) => {
                self.close_value(g);
                return self.feed(g, b);
            }
            _ => return false,
        };
        self.mode = Mode::Num { num: next, integer };
        true
    }
}

/// A vocabulary as JSON mode reads it: each token's bytes (`None` for control and
/// end-of-generation tokens, which no JSON text holds), the end-of-generation ids allowed once
/// the object is complete, and the masks computed so far (shared by every request of the model).
pub struct JsonVocab {
    pieces: Vec<Option<Box<[u8]>>>,
    /// Token ids by their first byte: a state tries each first byte once.
    by_first_byte: Vec<Vec<u32>>,
    /// Tokens that are plain string content (printable ASCII but `"` and `\`, whole UTF-8
    /// characters): allowed in any string outside an escape or a character, as a bitset, and
    /// the other tokens, the only ones a string state tries.
    plain: Vec<u64>,
    not_plain: Vec<u32>,
    /// Characters of each plain token (others 0): a string with a maximum length allows the
    /// plain tokens that fit in what is left of it.
    plain_chars: Vec<u16>,
    /// Between tokens of the JSON text, whitespace runs up to this long allow every token a
    /// shorter run allows (no token starts with more whitespace than the limit minus this):
    /// masks are cached under the state with its run raised to it.
    ws_floor: u8,
    ends: Vec<u32>,
    /// End-of-generation tokens that emit text where they do not end the request (not
    /// control tokens: under `ignore_eos` or before `min_tokens` their text is output).
    ends_with_text: Vec<u32>,
    /// Masks by grammar name and state, two generations (the newer filled, then it becomes
    /// the older).
    cache: Mutex<MaskCache>,
    /// Grammars by their schema text's SHA-256: a number that names each in the masks' keys
    /// (requests with equal schemas share their masks); cleared when full, numbers never
    /// reused.
    grammar_ids: Mutex<(HashMap<[u8; 32], u64>, u64)>,
}

/// Masks by grammar name and state: the newer generation, then the older one.
type MaskCache = [HashMap<(u64, JsonState), Arc<Vec<u64>>>; 2];

impl std::fmt::Debug for JsonVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonVocab")
            .field("tokens", &self.pieces.len())
            .field("ends", &self.ends)
            .finish()
    }
}

impl JsonVocab {
    /// From token pieces (`None`: a token no JSON text holds) and the end-of-generation ids.
    pub fn new(pieces: Vec<Option<Vec<u8>>>, ends: Vec<u32>) -> JsonVocab {
        let pieces: Vec<Option<Box<[u8]>>> = pieces
            .into_iter()
            .map(|p| p.filter(|p| !p.is_empty()).map(Vec::into_boxed_slice))
            .collect();
        let mut by_first_byte = vec![Vec::new(); 256];
        let mut lead_ws = 0usize;
        let mut plain = vec![0u64; pieces.len().div_ceil(64)];
        let mut not_plain = Vec::new();
        let mut plain_chars = vec![0u16; pieces.len()];
        let free = JsonGrammar::any_object();
        let in_string = JsonState {
            mode: Mode::Str {
                node: ANY,
                key: false,
                esc: 0,
                utf8: 0,
                first: 0,
                len: 0,
                dfa: 0,
            },
            ..JsonState::start(&free)
        };
        for (id, p) in pieces.iter().enumerate() {
            let Some(p) = p else { continue };
            by_first_byte[p[0] as usize].push(id as u32);
            let run = p
                .iter()
                .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
                .count();
            lead_ws = lead_ws.max(run);
            let content = !p.iter().any(|&b| b == b'"' || b == b'\\')
                && in_string.after(&free, p) == Some(in_string);
            if content {
                plain[id / 64] |= 1 << (id % 64);
                let chars = p.iter().filter(|&&b| !(0x80..=0xBF).contains(&b)).count();
                plain_chars[id] = chars.min(u16::MAX as usize) as u16;
            } else {
                not_plain.push(id as u32);
            }
        }
        JsonVocab {
            pieces,
            by_first_byte,
            plain,
            not_plain,
            plain_chars,
            ws_floor: (MAX_WHITESPACE_RUN as usize).saturating_sub(lead_ws) as u8,
            ends,
            ends_with_text: Vec::new(),
            cache: Mutex::new([HashMap::new(), HashMap::new()]),
            grammar_ids: Mutex::new((HashMap::new(), 0)),
        }
    }

    /// The number naming `g` in this vocabulary's mask cache.
    fn grammar_id(&self, g: &JsonGrammar) -> u64 {
        // Nothing panics while holding the lock; a poisoned one holds a whole map still.
        let mut ids = self
            .grammar_ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (map, next) = &mut *ids;
        if let Some(&id) = map.get(g.digest()) {
            return id;
        }
        if map.len() >= MAX_GRAMMAR_IDS {
            map.clear();
        }
        let id = *next;
        *next += 1;
        map.insert(*g.digest(), id);
        id
    }

    /// A model's vocabulary: the bytes each token emits into the text; end-of-generation,
    /// control and unknown tokens are never part of it.
    pub fn from_tokenizer(t: &Tokenizer) -> JsonVocab {
        let pieces = (0..t.vocab_size() as u32)
            .map(|id| (!t.is_eog(id)).then(|| t.emitted_bytes(id).to_vec()))
            .collect();
        let mut v = JsonVocab::new(pieces, t.eog_ids().to_vec());
        v.ends_with_text = t
            .eog_ids()
            .iter()
            .copied()
            .filter(|&id| !t.emitted_bytes(id).is_empty())
            .collect();
        v
    }

    /// Bitset over token ids: the tokens whose bytes continue `state` within grammar `g`
    /// (named `gid` in the cache).
    fn allowed(&self, g: &JsonGrammar, gid: u64, state: &JsonState) -> Arc<Vec<u64>> {
        let mut key = *state;
        if !matches!(
            key.mode,
            Mode::Str { .. } | Mode::Num { .. } | Mode::Lit { .. } | Mode::Key { .. }
        ) {
            // Between tokens of the text: only a token's leading whitespace adds to the run.
            key.ws = key.ws.max(self.ws_floor);
        }
        let state = &key;
        let key = (gid, key);
        if let Ok(mut c) = self.cache.lock() {
            if let Some(m) = c[0].get(&key).cloned() {
                return m;
            }
            if let Some(m) = c[1].remove(&key) {
                Self::insert_newer(&mut c, key, &m);
                return m;
            }
        }
        if let Mode::Str {
            node,
            esc: 0,
            utf8: 0,
            len,
            ..
        } = state.mode
        {
            if g.pattern(node).is_none() {
                // Plain content continues a string as far as its maximum length allows (the
                // minimum only matters at the closing quote); the rest is tried.
                let max = g.string_bounds(node).1;
                let mut bits = self.plain.clone();
                if max != UNBOUNDED {
                    let room = max.saturating_sub(len);
                    for (id, &c) in self.plain_chars.iter().enumerate() {
                        if c > room {
                            bits[id / 64] &= !(1 << (id % 64));
                        }
                    }
                }
                for &id in &self.not_plain {
                    let p = self.pieces[id as usize].as_deref().unwrap_or_default();
                    if state.after(g, p).is_some() {
                        bits[id as usize / 64] |= 1 << (id % 64);
                    }
                }
                return self.remember(key, bits);
            }
        }
        let mut bits = vec![0u64; self.pieces.len().div_ceil(64)];
        for (first, ids) in self.by_first_byte.iter().enumerate() {
            let mut s = *state;
            if ids.is_empty() || !s.feed(g, first as u8) {
                continue;
            }
            for &id in ids {
                let rest = self.pieces[id as usize]
                    .as_deref()
                    .map_or(&[][..], |p| &p[1..]);
                if s.after(g, rest).is_some() {
                    bits[id as usize / 64] |= 1 << (id % 64);
                }
            }
        }
        self.remember(key, bits)
    }

    fn remember(&self, key: (u64, JsonState), bits: Vec<u64>) -> Arc<Vec<u64>> {
        let bits = Arc::new(bits);
        if let Ok(mut c) = self.cache.lock() {
            Self::insert_newer(&mut c, key, &bits);
        }
        bits
    }

    /// Into the newer generation, which becomes the older one (the oldest dropped) when full.
    fn insert_newer(c: &mut MaskCache, key: (u64, JsonState), bits: &Arc<Vec<u64>>) {
        if c[0].len() >= MASK_CACHE_ENTRIES / 2 {
            c[1] = std::mem::take(&mut c[0]);
        }
        c[0].insert(key, Arc::clone(bits));
    }
}

/// One request's JSON mode or schema: the state after the tokens generated so far.
#[derive(Clone, Debug)]
pub struct JsonConstraint {
    vocab: Arc<JsonVocab>,
    grammar: Arc<JsonGrammar>,
    /// `grammar`'s number in `vocab`'s mask cache.
    gid: u64,
    /// `None` once a token outside the grammar was pushed (the rows are then left as they are).
    state: Option<JsonState>,
    /// What ends the request ([`crate::generate::TokenSink`]'s rule): its `stop_token_ids`,
    /// and end-of-generation tokens unless `ignore_eos`, once past `min_tokens`.
    stop_tokens: Vec<u32>,
    min_tokens: usize,
    ignore_eos: bool,
    /// Tokens pushed.
    generated: usize,
}

impl JsonConstraint {
    pub fn new(
        vocab: Arc<JsonVocab>,
        grammar: Arc<JsonGrammar>,
        stop_tokens: &[u32],
        min_tokens: usize,
        ignore_eos: bool,
    ) -> JsonConstraint {
        JsonConstraint {
            gid: vocab.grammar_id(&grammar),
            state: Some(JsonState::start(&grammar)),
            vocab,
            grammar,
            stop_tokens: stop_tokens.to_vec(),
            min_tokens,
            ignore_eos,
            generated: 0,
        }
    }

    /// The state after the tokens so far.
    pub fn state(&self) -> Option<JsonState> {
        self.state
    }

    /// The state after the tokens so far and then `path`.
    fn after(&self, path: &[u32]) -> Option<JsonState> {
        let mut s = self.state?;
        for (i, &t) in path.iter().enumerate() {
            s = self.step(s, t, self.generated + i + 1)?;
        }
        Some(s)
    }

    /// The state after `token`, generated as the `n`-th token.
    fn step(&self, s: JsonState, token: u32, n: usize) -> Option<JsonState> {
        if s.is_done() && self.end_allowed(token, n) {
            return Some(s);
        }
        s.after(
            &self.grammar,
            self.vocab.pieces.get(token as usize)?.as_deref()?,
        )
    }

    /// Whether the complete object may be followed by `token` as the `n`-th token whatever its
    /// text: it ends the request there, or it is an end or stop token without text (the
    /// request goes on, e.g. under `ignore_eos`, and nothing is emitted).
    fn end_allowed(&self, token: u32, n: usize) -> bool {
        let end = self.vocab.ends.contains(&token);
        let stop = self.stop_tokens.contains(&token);
        let ends_here = n > self.min_tokens && ((end && !self.ignore_eos) || stop);
        let textless = self
            .vocab
            .pieces
            .get(token as usize)
            .is_none_or(Option::is_none)
            && !self.vocab.ends_with_text.contains(&token);
        ends_here || ((end || stop) && textless)
    }

    /// Count a generated token.
    pub fn push(&mut self, token: u32) {
        self.generated += 1;
        self.state = self.state.and_then(|s| self.step(s, token, self.generated));
    }

    /// Set to -inf the logit of every token of `row` that cannot follow the tokens so far and
    /// then `path`: before the object is complete the JSON text's continuations, then
    /// whitespace and the tokens that end the request. A path that already left the grammar
    /// (a draft the verification rejects before it reads this row) leaves the row, and so does
    /// a state no token can follow (a vocabulary without end tokens).
    pub fn mask_row(&self, row: &mut [f32], path: &[u32]) {
        let Some(state) = self.after(path) else {
            return;
        };
        let bits = self.vocab.allowed(&self.grammar, self.gid, &state);
        let n = self.generated + path.len() + 1;
        let keep: Vec<(usize, f32)> = if state.is_done() {
            self.vocab
                .ends
                .iter()
                .chain(&self.stop_tokens)
                .filter(|&&t| self.end_allowed(t, n))
                .filter_map(|&t| row.get(t as usize).map(|&l| (t as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        if keep.is_empty() && bits.iter().all(|&w| w == 0) {
            return;
        }
        for (k, chunk) in row.chunks_mut(64).enumerate() {
            let w = bits.get(k).copied().unwrap_or(0);
            if w == u64::MAX {
                continue;
            }
            if w == 0 {
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if w >> i & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        for (t, l) in keep {
            row[t] = l;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn free() -> Arc<JsonGrammar> {
        JsonGrammar::any_object()
    }

    /// A xorshift64 stream from `seed`.
    pub(crate) fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// 3000 random token pieces of 1 to 5 bytes of `alphabet`.
    pub(crate) fn random_pieces(alphabet: &[u8], seed: u64) -> Vec<Option<Vec<u8>>> {
        let mut next = xorshift(seed);
        (0..3000)
            .map(|_| {
                let len = 1 + next() % 5;
                Some(
                    (0..len)
                        .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                        .collect(),
                )
            })
            .collect()
    }

    fn valid(text: &str) -> bool {
        JsonState::start(&free())
            .after(&free(), text.as_bytes())
            .is_some_and(|s| s.is_done())
    }

    fn prefix(text: &str) -> bool {
        JsonState::start(&free())
            .after(&free(), text.as_bytes())
            .is_some()
    }

    #[test]
    fn complete_objects_are_accepted_and_agree_with_serde() {
        let good = [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,2.5,-3e+2,0,0.0e-1,true,false,null,\"x\\n\\u00e9\"],\"b\":{\"c\":{}}}",
            "{\n  \"name\": \"Ada\",\n  \"tags\": [],\n  \"n\": -0.5E3\n}",
            "{\"é\": \"日本語 🙂\"}",
            "{\"a\": [[[]]], \"b\": [{}]}",
        ];
        for g in good {
            assert!(valid(g), "{g}");
            let v: serde_json::Value = serde_json::from_str(g).unwrap();
            assert!(v.is_object());
        }
        let bad = [
            "[1]",
            "1",
            "\"s\"",
            "{\"a\" 1}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":1e}",
            "{\"a\":tru}x",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":\"tab\there\"}",
            "{a:1}",
            "{\"a\":1]",
            "{\"a\":[1}",
            "{}}",
            "{} x",
        ];
        for b in bad {
            assert!(!valid(b), "{b}");
            assert!(serde_json::from_str::<serde_json::Value>(b).map_or(true, |v| !v.is_object()));
        }
        // Prefixes of valid texts are live; the texts above die at their first bad byte.
        assert!(prefix("{\"a\": [1, 2"));
        assert!(prefix("{\"a\": \"\\u00"));
        assert!(!prefix("{\"a\": \"\\u00g"));
        assert!(!prefix("{\"a\" 1"));
        // Broken UTF-8 inside strings.
        assert!(JsonState::start(&free())
            .after(&free(), b"{\"a\":\"\xC3\xA9\"}")
            .is_some());
        assert!(JsonState::start(&free())
            .after(&free(), b"{\"a\":\"\xC3\"")
            .is_none());
        assert!(JsonState::start(&free())
            .after(&free(), b"{\"a\":\"\xFF")
            .is_none());
        // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
        for bad in [
            &b"\xE0\x80\x80"[..],
            b"\xED\xA0\x80",
            b"\xF0\x80\x80\x80",
            b"\xF4\x90\x80\x80",
            b"\xC0\x80",
        ] {
            let text = [&b"{\"a\":\""[..], bad].concat();
            assert!(
                JsonState::start(&free()).after(&free(), &text).is_none(),
                "{bad:?}"
            );
        }
        for good in [
            "\u{7FF}",
            "\u{800}",
            "\u{D7FF}",
            "\u{E000}",
            "\u{FFFF}",
            "\u{10000}",
            "\u{10FFFF}",
        ] {
            assert!(valid(&format!("{{\"a\":\"{good}\"}}")), "{good:?}");
        }
    }

    #[test]
    fn nesting_and_whitespace_are_bounded() {
        let deep = "[".repeat(MAX_DEPTH as usize - 1);
        assert!(prefix(&format!("{{\"a\":{deep}")));
        assert!(!prefix(&format!("{{\"a\":{deep}[")));
        let ws = " ".repeat(MAX_WHITESPACE_RUN as usize);
        assert!(prefix(&format!("{{{ws}")));
        assert!(!prefix(&format!("{{{ws} ")));
        assert!(valid(&format!("{{}}{ws}")));
        assert!(!valid(&format!("{{}}{ws} ")));
    }

    /// A hand-built vocabulary: the masks allow exactly the tokens that continue the text,
    /// end tokens only once the object is complete, stop tokens with them.
    #[test]
    fn masks_follow_the_state() {
        let pieces: Vec<Option<Vec<u8>>> = [
            "{", "}", "\"", "a", ":", "1", " ", "{\"", "\":", "}\n", "x", "", "<ctl>",
        ]
        .iter()
        .enumerate()
        .map(|(i, p)| (i != 12).then(|| p.as_bytes().to_vec()))
        .chain([None]) // 13: end of generation
        .collect();
        let vocab = Arc::new(JsonVocab::new(pieces, vec![13]));
        let allowed = |c: &JsonConstraint, path: &[u32]| -> Vec<usize> {
            let mut row = vec![0.5f32; 15];
            c.mask_row(&mut row, path);
            (0..15).filter(|&i| row[i] == 0.5).collect()
        };
        let mut c = JsonConstraint::new(Arc::clone(&vocab), free(), &[10], 0, false);
        // Start: `{`, `{"`, whitespace; row entries past the vocabulary are masked too.
        assert_eq!(allowed(&c, &[]), vec![0, 6, 7]);
        c.push(7); // {"
                   // In a key: any text byte (a newline is not one), the closing quote.
        assert_eq!(allowed(&c, &[]), vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 10]);
        // After `{"a":` (a draft path): a value or whitespace (`":` opens a string).
        assert_eq!(allowed(&c, &[3, 8]), vec![0, 2, 5, 6, 7, 8]);
        for t in [3, 8, 5] {
            c.push(t); // {"a":1
        }
        assert_eq!(allowed(&c, &[]), vec![1, 5, 6, 9]);
        c.push(1);
        assert!(c.state().is_some_and(|s| s.is_done()));
        // Complete: whitespace, the end token and the stop token.
        assert_eq!(allowed(&c, &[]), vec![6, 10, 13]);
        c.push(13);
        assert!(c.state().is_some_and(|s| s.is_done()));
        // A token outside the grammar kills the state; rows are then left alone.
        c.push(3);
        assert_eq!(c.state(), None);
        assert_eq!(allowed(&c, &[]).len(), 15);
        // Before `min_tokens` a stop token with text would be emitted, not end the request:
        // masked after the object, the textless end token kept (from the 8th token on, as
        // the 8th ends the request, the stop token too).
        let mut c = JsonConstraint::new(Arc::clone(&vocab), free(), &[10], 7, false);
        for t in [0, 1] {
            c.push(t); // {}
        }
        assert_eq!(allowed(&c, &[]), vec![6, 13]);
        assert_eq!(allowed(&c, &[6, 6, 6, 6]), vec![6, 13]);
        assert_eq!(allowed(&c, &[6, 6, 6, 6, 6]), vec![6, 10, 13]);
        // An end token with text under `ignore_eos` would be emitted: masked after the object.
        // Token 2 ends generation: "a" in the first vocabulary, a non-control token (no
        // piece, text when decoded) in the second.
        let with_piece = JsonVocab::new(
            ["{", "}", "a", " "]
                .iter()
                .map(|p| Some(p.as_bytes().to_vec()))
                .collect(),
            vec![2],
        );
        let mut eos_text = JsonVocab::new(
            vec![
                Some(b"{".to_vec()),
                Some(b"}".to_vec()),
                None,
                Some(b" ".to_vec()),
            ],
            vec![2],
        );
        eos_text.ends_with_text = vec![2];
        for v in [Arc::new(with_piece), Arc::new(eos_text)] {
            for (ignore_eos, want) in [(false, vec![2, 3]), (true, vec![3])] {
                let mut c = JsonConstraint::new(Arc::clone(&v), free(), &[], 0, ignore_eos);
                c.push(0);
                c.push(1);
                let mut row = vec![0.5f32; 4];
                c.mask_row(&mut row, &[]);
                let got: Vec<usize> = (0..4).filter(|&i| row[i] == 0.5).collect();
                assert_eq!(got, want, "ignore_eos {ignore_eos}");
            }
        }
        // No token can follow (no end tokens, the whitespace run full): the row is left.
        let no_ends = Arc::new(JsonVocab::new(
            vec![Some(b"{}".to_vec()), Some(b" ".to_vec())],
            vec![],
        ));
        let mut c = JsonConstraint::new(no_ends, free(), &[], 0, false);
        for _ in 0..=MAX_WHITESPACE_RUN {
            c.push(if c.state().is_some_and(|s| s.is_done()) {
                1
            } else {
                0
            });
        }
        let mut row = vec![0.5f32; 2];
        c.mask_row(&mut row, &[]);
        assert_eq!(row, vec![0.5, 0.5]);
    }

    /// The masks (first bytes tried once per state) equal each token tried on its own, over
    /// a vocabulary of random JSON-ish pieces and the states along a long object.
    #[test]
    fn masks_equal_a_token_by_token_check() {
        let pieces = random_pieces(
            b"{}[]\":, \n0123456789-+.eEtruefalsnl\\abu\xC3\xA9",
            0x9E37_79B9_7F4A_7C15,
        );
        let vocab = JsonVocab::new(pieces.clone(), vec![]);
        let text = r#"{"a": [1, -2.5e+3, true, null, {"b": "x\u00e9\n é"}], "c": {}, "d": false}"#;
        let g = free();
        let mut state = JsonState::start(&g);
        let mut checked = 0;
        for &b in text.as_bytes() {
            let bits = vocab.allowed(&g, 0, &state);
            for (id, p) in pieces.iter().enumerate() {
                let want = state.after(&g, p.as_deref().unwrap()).is_some();
                assert_eq!(bits[id / 64] >> (id % 64) & 1 == 1, want, "{state:?} {p:?}");
                checked += want as usize;
            }
            assert!(state.feed(&g, b), "{}", b as char);
        }
        assert!(state.is_done());
        assert!(checked > 1000, "{checked}");
    }
}
