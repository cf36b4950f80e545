//! JSON schemas compiled into the grammar JSON mode's automaton walks (OpenAI's structured outputs, `response_format: {"type": "json_schema"}`): a graph of nodes (objects with their properties in order, arrays, strings, numbers, literal sets, unions told apart by their first byte), as outlines and llama.cpp's `json-schema-to-grammar` turn schemas into regular expressions and grammars.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use serde_json::{Map, Value};
use sha2::Digest;

use crate::error::{EngineError, Result};

/// A node of a grammar, by its index.
pub(crate) type NodeId = u16;

/// Any JSON value (free JSON: objects, arrays, strings, numbers, literals).
pub(crate) const ANY: NodeId = 0;
/// `true`, `false` and `null`, as free JSON reads them.
pub(crate) const FREE_LITERALS: NodeId = 1;
/// Any JSON object (`json_object` mode's root).
const ANY_OBJECT: NodeId = 2;

/// No upper bound on a count (`maxItems`, `maxLength`); bounds are at most one less.
pub(crate) const UNBOUNDED: u16 = u16::MAX;
/// Deepest nesting of a schema's objects and arrays (one frame each in the automaton's state).
pub const MAX_SCHEMA_DEPTH: usize = 16;
/// Deepest nesting of schemas in a schema, `$ref` chains included (compiling recurses).
const MAX_COMPILE_DEPTH: usize = 64;
/// Most nodes of one compiled schema.
const MAX_NODES: usize = 4096;
/// Most properties of one object and values of one `enum` (a bitset of candidates each).
pub const MAX_CHOICES: usize = 64;
/// Longest property name and `enum` value as JSON text (bytes; the automaton counts in a `u8`).
pub const MAX_LITERAL_BYTES: usize = 255;

/// The keywords a schema may hold: what they constrain, and annotations read for nothing.
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "$ref",
];
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
];

/// What a value may be.
#[derive(Debug)]
pub(crate) enum Node {
    Any,
    AnyObject,
    /// An object holding these properties in this order (required ones always, the others
    /// where the model writes them), and no other.
    Object(Vec<Prop>),
    Array {
        items: NodeId,
        min: u16,
        max: u16,
    },
    /// A string of `min..=max` characters (an escape counts as one), matching
    /// `JsonGrammar::patterns[pattern]` where it has one.
    String {
        min: u16,
        max: u16,
        pattern: Option<u16>,
    },
    Number {
        integer: bool,
    },
    /// One of these JSON texts, byte for byte (`enum`, `const`, `true`/`false`, `null`).
    Literals(Vec<Box<[u8]>>),
    /// One of these nodes, picked by the value's first byte (no two start alike).
    Union(Vec<NodeId>),
    /// A `$ref` still being compiled.
    Pending,
}

/// One property of a schema object.
#[derive(Debug)]
pub(crate) struct Prop {
    /// The name as JSON text, quotes included.
    pub key: Box<[u8]>,
    pub node: NodeId,
    pub required: bool,
}

/// A JSON schema as a request carries it: compiled on first use, once for all the request's
/// choices (the server does it on its prompt tokenizer's thread, neither on the event loop
/// nor on the thread that runs the steps); a schema Arbor cannot compile fails there with
/// `invalid_argument`. Compiled schemas (and refusals) are kept per process by the SHA-256 of
/// their text, so a schema sent again is not compiled again.
pub struct JsonSchema {
    schema: Value,
    grammar: OnceLock<std::result::Result<Arc<JsonGrammar>, String>>,
}

impl JsonSchema {
    pub fn new(schema: Value) -> JsonSchema {
        JsonSchema {
            schema,
            grammar: OnceLock::new(),
        }
    }

    /// The schema as given.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// The compiled grammar ([`JsonGrammar::from_schema`]), compiled on the first call.
    pub fn grammar(&self) -> Result<Arc<JsonGrammar>> {
        self.grammar
            .get_or_init(|| {
                let text = serde_json::to_string(&self.schema).unwrap_or_default();
                let digest: [u8; 32] = sha2::Sha256::digest(text.as_bytes()).into();
                if let Some(done) = compiled_get(&digest) {
                    return done;
                }
                let done = JsonGrammar::compile(&self.schema, text, digest)
                    .map(Arc::new)
                    .map_err(|e| match e {
                        EngineError::InvalidArgument(m) => m,
                        e => e.to_string(),
                    });
                compiled_put(digest, &done);
                done
            })
            .clone()
            .map_err(EngineError::InvalidArgument)
    }
}

/// What compiling a schema gave.
type Compiled = std::result::Result<Arc<JsonGrammar>, String>;

/// Schemas compiled in this process, most recently used first: at most [`COMPILED_ENTRIES`]
/// and [`COMPILED_PATTERN_STATES`] pattern states in all (their tables are 1 KiB a state).
static COMPILED: std::sync::Mutex<Vec<([u8; 32], Compiled)>> = std::sync::Mutex::new(Vec::new());
const COMPILED_ENTRIES: usize = 64;
const COMPILED_PATTERN_STATES: usize = 4 * MAX_PATTERN_STATES;

fn compiled_get(digest: &[u8; 32]) -> Option<Compiled> {
    let mut c = COMPILED.lock().ok()?;
    let i = c.iter().position(|(d, _)| d == digest)?;
    let hit = c.remove(i);
    let out = hit.1.clone();
    c.insert(0, hit);
    Some(out)
}

fn compiled_put(digest: [u8; 32], done: &Compiled) {
    let Ok(mut c) = COMPILED.lock() else {
        return;
    };
    c.insert(0, (digest, done.clone()));
    let states = |e: &([u8; 32], Compiled)| {
        e.1.as_ref().map_or(0, |g| {
            g.patterns.iter().map(|p| p.accept.len()).sum::<usize>()
        })
    };
    while c.len() > COMPILED_ENTRIES
        || (c.len() > 1 && c.iter().map(states).sum::<usize>() > COMPILED_PATTERN_STATES)
    {
        c.pop();
    }
}

impl PartialEq for JsonSchema {
    /// Equal texts (property order matters: it is the output's order).
    fn eq(&self, other: &Self) -> bool {
        serde_json::to_string(&self.schema).ok() == serde_json::to_string(&other.schema).ok()
    }
}

impl Eq for JsonSchema {}

impl std::fmt::Debug for JsonSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.schema.to_string();
        f.debug_tuple("JsonSchema")
            .field(&text.chars().take(80).collect::<String>())
            .finish()
    }
}

/// A compiled schema (or JSON mode's "any object"): the nodes, the first bytes each can start
/// with, the root, and the schema's text, which names it (equal texts, equal grammars).
pub struct JsonGrammar {
    nodes: Vec<Node>,
    /// Per node: bit `b` set where a value of the node can start with byte `b`.
    first: Vec<[u64; 4]>,
    /// Per node: the fewest schema frames a value of it opens (objects and arrays it cannot
    /// do without; `u16::MAX` where no finite value exists).
    frames: Vec<u16>,
    root: NodeId,
    text: String,
    /// SHA-256 of `text`: names the grammar in a vocabulary's mask cache.
    digest: [u8; 32],
    /// The string patterns (`pattern`, `format`) as byte automata.
    patterns: Vec<Pattern>,
}

/// A string pattern as a byte automaton over the string's raw bytes (no escapes): state 0
/// starts; `next[s * 256 + b]` is the state after byte `b`, [`Pattern::DEAD`] where no string
/// matching the pattern can follow; `accept[s]`: the string may end in state `s`.
pub(crate) struct Pattern {
    next: Vec<u32>,
    accept: Vec<bool>,
}

impl Pattern {
    pub(crate) const DEAD: u32 = u32::MAX;

    pub(crate) fn step(&self, s: u32, b: u8) -> u32 {
        self.next[s as usize * 256 + b as usize]
    }

    pub(crate) fn accepts(&self, s: u32) -> bool {
        self.accept[s as usize]
    }
}

impl std::fmt::Debug for JsonGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut end = self.text.len().min(80);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        f.debug_struct("JsonGrammar")
            .field("nodes", &self.nodes.len())
            .field("schema", &&self.text[..end])
            .finish()
    }
}

impl PartialEq for JsonGrammar {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest && self.text == other.text
    }
}

impl Eq for JsonGrammar {}

impl JsonGrammar {
    /// JSON mode: one object, any keys and values.
    pub fn any_object() -> Arc<JsonGrammar> {
        static G: OnceLock<Arc<JsonGrammar>> = OnceLock::new();
        Arc::clone(G.get_or_init(|| {
            let c = Compiler::new(&Value::Null);
            let text = "json_object".to_string();
            let digest = sha2::Sha256::digest(text.as_bytes()).into();
            let g = c.finish(ANY_OBJECT, text, digest);
            Arc::new(g.unwrap_or_else(|_| unreachable!("no unions, no frames")))
        }))
    }

    /// Compile a JSON schema (the subset [`KEYWORDS`] lists; annotations such as `title` are
    /// read for nothing); an `invalid_argument` error names what is not supported and where.
    /// Objects hold their properties in the schema's order and no others
    /// (`additionalProperties: false`, as OpenAI's strict mode requires); the root is an object
    /// or an array.
    pub fn from_schema(schema: &Value) -> Result<JsonGrammar> {
        let text = serde_json::to_string(schema).unwrap_or_default();
        let digest = sha2::Sha256::digest(text.as_bytes()).into();
        JsonGrammar::compile(schema, text, digest)
    }

    /// [`JsonGrammar::from_schema`] with the schema's text and its SHA-256.
    fn compile(schema: &Value, text: String, digest: [u8; 32]) -> Result<JsonGrammar> {
        let mut c = Compiler::new(schema);
        let root = c.compile(schema, "#", 0)?;
        let unions = std::mem::take(&mut c.unions);
        // Cycles through unions are refused here, before anything walks them.
        let g = c.finish(root, text, digest)?;
        if !g.is_container(root) {
            return Err(invalid(
                "#",
                "the root of a response schema must be an object or an array",
            ));
        }
        if g.frames[root as usize] as usize > MAX_SCHEMA_DEPTH {
            return Err(invalid(
                "#",
                &format!(
                    "every instance nests more than {MAX_SCHEMA_DEPTH} objects / arrays (or \
                     none is finite: a required property that holds its own object)"
                ),
            ));
        }
        g.check_unions(&unions)?;
        Ok(g)
    }

    /// Whether every value of `id` is an object or an array.
    fn is_container(&self, id: NodeId) -> bool {
        match self.node(id) {
            Node::Object(_) | Node::AnyObject | Node::Array { .. } => true,
            Node::Union(opts) => opts.iter().all(|&o| self.is_container(o)),
            _ => false,
        }
    }

    /// Whether a value of `id` can be completed with `depth` schema frames open.
    pub(crate) fn fits(&self, id: NodeId, depth: u8) -> bool {
        (depth as usize).saturating_add(self.frames[id as usize] as usize) <= MAX_SCHEMA_DEPTH
    }

    /// The SHA-256 of the schema's text.
    pub(crate) fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    pub(crate) fn root(&self) -> NodeId {
        self.root
    }

    pub(crate) fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Whether a value of `id` can start with `b`.
    pub(crate) fn starts_with(&self, id: NodeId, b: u8) -> bool {
        self.first[id as usize][b as usize / 64] >> (b % 64) & 1 == 1
    }

    /// The option of union `opts` a value starting with `b` belongs to.
    pub(crate) fn pick(&self, opts: &[NodeId], b: u8) -> Option<NodeId> {
        opts.iter().copied().find(|&o| self.starts_with(o, b))
    }

    /// The properties of object `id` (none for other nodes).
    pub(crate) fn props(&self, id: NodeId) -> &[Prop] {
        match self.node(id) {
            Node::Object(p) => p,
            _ => &[],
        }
    }

    /// The properties whose key may come next in object `id` after `count` of them were
    /// passed, with `depth` schema frames open (the object's included): each one up to the
    /// first required one, optional ones only where their value fits in the frames left.
    pub(crate) fn next_keys(&self, id: NodeId, count: u16, depth: u8) -> u64 {
        let mut bits = 0u64;
        for (i, p) in self.props(id).iter().enumerate().skip(count as usize) {
            if p.required {
                return bits | 1 << i;
            }
            if self.fits(p.node, depth) {
                bits |= 1 << i;
            }
        }
        bits
    }

    /// Whether object `id` may close after `count` properties were passed.
    pub(crate) fn may_close(&self, id: NodeId, count: u16) -> bool {
        !self
            .props(id)
            .iter()
            .skip(count as usize)
            .any(|p| p.required)
    }

    /// A string node's bounds in characters (free strings: none).
    pub(crate) fn string_bounds(&self, id: NodeId) -> (u16, u16) {
        match self.node(id) {
            Node::String { min, max, .. } => (*min, *max),
            _ => (0, UNBOUNDED),
        }
    }

    /// A string node's pattern.
    pub(crate) fn pattern(&self, id: NodeId) -> Option<&Pattern> {
        match self.node(id) {
            Node::String {
                pattern: Some(p), ..
            } => self.patterns.get(*p as usize),
            _ => None,
        }
    }

    /// An array node's element node and bounds.
    pub(crate) fn array(&self, id: NodeId) -> Option<(NodeId, u16, u16)> {
        match self.node(id) {
            Node::Array { items, min, max } => Some((*items, *min, *max)),
            _ => None,
        }
    }

    /// The literal texts of node `id` (free JSON's `true` / `false` / `null` for others).
    pub(crate) fn literals(&self, id: NodeId) -> &[Box<[u8]>] {
        match self.node(id) {
            Node::Literals(v) => v,
            _ => &[],
        }
    }

    /// No union (`unions`: each with its schema path) has two options that can start with
    /// one byte: the automaton picks an option at the value's first byte.
    fn check_unions(&self, unions: &[(NodeId, String)]) -> Result<()> {
        for (id, path) in unions {
            let Node::Union(opts) = self.node(*id) else {
                continue;
            };
            let mut seen = [0u64; 4];
            for &o in opts {
                let f = self.first[o as usize];
                if let Some(w) = (0..4).find(|&w| seen[w] & f[w] != 0) {
                    let byte = (w * 64) as u8 + (seen[w] & f[w]).trailing_zeros() as u8;
                    return Err(invalid(
                        path,
                        &format!(
                            "the options of an anyOf / oneOf / type list must start \
                             differently (as a string, a number and null do); two can start \
                             with '{}'",
                            byte.escape_ascii()
                        ),
                    ));
                }
                for (s, x) in seen.iter_mut().zip(f) {
                    *s |= x;
                }
            }
        }
        Ok(())
    }
}

fn invalid(path: &str, what: &str) -> EngineError {
    EngineError::InvalidArgument(format!("JSON schema at {path}: {what}"))
}

/// Compiles one schema into nodes.
struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    /// `$ref` targets compiled (or being compiled) so far.
    refs: HashMap<String, NodeId>,
    /// Unions written in the schema (`anyOf`, `oneOf`, type lists) and where.
    unions: Vec<(NodeId, String)>,
    patterns: Vec<Pattern>,
    /// States of all patterns so far.
    pattern_states: usize,
}

impl<'a> Compiler<'a> {
    fn new(root: &'a Value) -> Compiler<'a> {
        let lits = ["true", "false", "null"].map(|w| w.as_bytes().into());
        Compiler {
            root,
            nodes: vec![Node::Any, Node::Literals(lits.to_vec()), Node::AnyObject],
            refs: HashMap::new(),
            unions: Vec::new(),
            patterns: Vec::new(),
            pattern_states: 0,
        }
    }

    fn push(&mut self, n: Node, path: &str) -> Result<NodeId> {
        if self.nodes.len() >= MAX_NODES {
            return Err(invalid(
                path,
                &format!("the schema compiles to more than {MAX_NODES} nodes"),
            ));
        }
        self.nodes.push(n);
        Ok((self.nodes.len() - 1) as NodeId)
    }

    /// The nodes' first bytes, computed through unions; a union that reaches itself before a
    /// byte is read (`{"$ref": "#/$defs/A"}` as A's body) is refused.
    fn finish(self, root: NodeId, text: String, digest: [u8; 32]) -> Result<JsonGrammar> {
        let mut first = vec![None; self.nodes.len()];
        let mut visiting = vec![false; self.nodes.len()];
        for id in 0..self.nodes.len() {
            first_bytes(&self.nodes, id, &mut first, &mut visiting)?;
        }
        Ok(JsonGrammar {
            first: first.into_iter().map(Option::unwrap_or_default).collect(),
            frames: frames_needed(&self.nodes),
            nodes: self.nodes,
            root,
            text,
            digest,
            patterns: self.patterns,
        })
    }

    fn compile(&mut self, s: &Value, path: &str, depth: usize) -> Result<NodeId> {
        if depth > MAX_COMPILE_DEPTH {
            return Err(invalid(
                path,
                &format!("schemas nest (or '$ref's chain) more than {MAX_COMPILE_DEPTH} deep"),
            ));
        }
        let o = match s {
            Value::Bool(true) => return Ok(ANY),
            Value::Object(o) => o,
            _ => return Err(invalid(path, "a schema must be an object (or `true`)")),
        };
        if let Some(k) = o
            .keys()
            .find(|k| !KEYWORDS.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()))
        {
            return Err(invalid(
                path,
                &format!(
                    "keyword '{}' is not supported (supported: {})",
                    k.chars().take(64).collect::<String>(),
                    KEYWORDS.join(", ")
                ),
            ));
        }
        let beside = |key: &str, allowed: &[&str]| match KEYWORDS
            .iter()
            .find(|k| **k != key && !allowed.contains(k) && o.contains_key(**k))
        {
            Some(k) => Err(invalid(
                path,
                &format!("'{k}' cannot sit beside '{key}' (not supported)"),
            )),
            None => Ok(()),
        };
        if let Some(r) = o.get("$ref") {
            beside("$ref", &[])?;
            return self.reference(r, path, depth);
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(v) = o.get(key) {
                beside(key, &[])?;
                let Value::Array(list) = v else {
                    return Err(invalid(path, &format!("'{key}' must be an array")));
                };
                if list.is_empty() || list.len() > MAX_CHOICES {
                    return Err(invalid(
                        path,
                        &format!("'{key}' must hold 1 to {MAX_CHOICES} schemas"),
                    ));
                }
                let mut opts = Vec::with_capacity(list.len());
                for (i, s) in list.iter().enumerate() {
                    opts.push(self.compile(s, &format!("{path}/{key}/{i}"), depth + 1)?);
                }
                return self.union(opts, path);
            }
        }
        for key in ["enum", "const"] {
            if let Some(v) = o.get(key) {
                beside(key, &["type"])?;
                let values = match (key, v) {
                    ("const", v) => std::slice::from_ref(v),
                    (_, Value::Array(values)) => &values[..],
                    _ => return Err(invalid(path, "'enum' must be an array")),
                };
                if let Some(t) = o.get("type") {
                    let types: Vec<&str> = match t {
                        Value::String(t) => vec![t],
                        Value::Array(t) => t.iter().filter_map(Value::as_str).collect(),
                        _ => vec![],
                    };
                    if let Some(v) = values.iter().find(|v| !types.iter().any(|t| is_type(v, t))) {
                        return Err(invalid(
                            path,
                            &format!(
                                "'{key}' value {} is not of the schema's 'type'",
                                v.to_string().chars().take(64).collect::<String>()
                            ),
                        ));
                    }
                }
                return self.literals(values, path);
            }
        }
        match o.get("type") {
            None if o.contains_key("properties") => self.typed(o, "object", path, depth),
            None if o.contains_key("items") => self.typed(o, "array", path, depth),
            None => match KEYWORDS.iter().find(|k| o.contains_key(**k)) {
                Some(k) => Err(invalid(path, &format!("'{k}' needs a 'type'"))),
                None => Ok(ANY),
            },
            Some(Value::String(t)) => self.typed(o, t, path, depth),
            Some(Value::Array(types)) => {
                if types.is_empty() || types.len() > 7 {
                    return Err(invalid(path, "'type' must list 1 to 7 types"));
                }
                let mut opts = Vec::with_capacity(types.len());
                for t in types {
                    let Value::String(t) = t else {
                        return Err(invalid(path, "'type' must list type names"));
                    };
                    opts.push(self.typed(o, t, path, depth)?);
                }
                self.union(opts, path)
            }
            Some(_) => Err(invalid(path, "'type' must be a string or an array of them")),
        }
    }

    fn union(&mut self, opts: Vec<NodeId>, path: &str) -> Result<NodeId> {
        let id = self.push(Node::Union(opts), path)?;
        self.unions.push((id, path.to_string()));
        Ok(id)
    }

    /// A schema of one type (its other keywords read where they apply to it).
    fn typed(
        &mut self,
        o: &Map<String, Value>,
        t: &str,
        path: &str,
        depth: usize,
    ) -> Result<NodeId> {
        let count = |k: &str| -> Result<Option<u16>> {
            let Some(v) = o.get(k) else {
                return Ok(None);
            };
            let n = v
                .as_u64()
                .or_else(|| {
                    v.as_f64()
                        .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                        .map(|f| f as u64)
                })
                .ok_or_else(|| invalid(path, &format!("'{k}' must be a non-negative integer")))?;
            if n >= UNBOUNDED as u64 {
                return Err(invalid(
                    path,
                    &format!("'{k}' must be below {UNBOUNDED} (counts are bounded)"),
                ));
            }
            Ok(Some(n as u16))
        };
        let bounds = |lo: &str, hi: &str| -> Result<(u16, u16)> {
            let min = count(lo)?.unwrap_or(0);
            let max = count(hi)?.unwrap_or(UNBOUNDED);
            if min > max {
                return Err(invalid(path, &format!("'{lo}' is above '{hi}'")));
            }
            Ok((min, max))
        };
        let node = match t {
            "string" => {
                let (min, max) = bounds("minLength", "maxLength")?;
                let regex = match (o.get("pattern"), o.get("format")) {
                    (Some(_), Some(_)) => {
                        return Err(invalid(path, "'pattern' beside 'format' is not supported"))
                    }
                    (Some(Value::String(p)), None) => {
                        // Checked alone first, so that the wrapping cannot change its meaning.
                        regex_automata::util::syntax::parse(p)
                            .map_err(|e| invalid(path, &format!("'pattern': {e}")))?;
                        // JSON Schema's patterns match anywhere in the string.
                        Some(format!("(?s:.*)(?:{p})(?s:.*)"))
                    }
                    (None, Some(Value::String(f))) => match format_regex(f) {
                        Some(r) => Some(r.to_string()),
                        None => {
                            return Err(invalid(
                                path,
                                &format!(
                                    "'format' '{}' is not supported ({})",
                                    f.chars().take(32).collect::<String>(),
                                    FORMATS
                                        .iter()
                                        .map(|(n, _)| *n)
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                ),
                            ))
                        }
                    },
                    (Some(_), None) => return Err(invalid(path, "'pattern' must be a string")),
                    (None, Some(_)) => return Err(invalid(path, "'format' must be a string")),
                    (None, None) => None,
                };
                let pattern = match regex {
                    Some(_) if (min, max) != (0, UNBOUNDED) => {
                        return Err(invalid(
                            path,
                            "'minLength' / 'maxLength' beside 'pattern' / 'format' are not \
                             supported (write the length into the pattern)",
                        ))
                    }
                    Some(r) => Some(self.pattern(&r, path)?),
                    None => None,
                };
                Node::String { min, max, pattern }
            }
            "integer" => Node::Number { integer: true },
            "number" => Node::Number { integer: false },
            "boolean" => {
                Node::Literals(vec![b"true".as_slice().into(), b"false".as_slice().into()])
            }
            "null" => Node::Literals(vec![b"null".as_slice().into()]),
            "array" => {
                let (min, max) = bounds("minItems", "maxItems")?;
                let slot = self.push(Node::Pending, path)?;
                let items = match o.get("items") {
                    None => ANY,
                    Some(Value::Array(_)) => {
                        return Err(invalid(
                            path,
                            "tuple 'items' (a list of schemas) is not supported",
                        ))
                    }
                    Some(s) => self.compile(s, &format!("{path}/items"), depth + 1)?,
                };
                self.nodes[slot as usize] = Node::Array { items, min, max };
                return Ok(slot);
            }
            "object" => {
                match o.get("additionalProperties") {
                    None | Some(Value::Bool(false)) => {}
                    Some(Value::Bool(true)) if !o.contains_key("properties") => {}
                    Some(_) => {
                        return Err(invalid(
                            path,
                            "'additionalProperties' other than false is not supported beside \
                             'properties' (objects hold exactly their listed properties)",
                        ))
                    }
                }
                let Some(props) = o.get("properties") else {
                    if o.get("required")
                        .is_some_and(|r| r.as_array().is_some_and(|r| !r.is_empty()))
                    {
                        return Err(invalid(
                            path,
                            "'required' names properties it does not list",
                        ));
                    }
                    if o.get("additionalProperties") == Some(&Value::Bool(false)) {
                        // No properties and no others: `{}`.
                        return self.push(Node::Object(Vec::new()), path);
                    }
                    return Ok(ANY_OBJECT);
                };
                return self.object(o, props, path, depth);
            }
            other => {
                return Err(invalid(
                    path,
                    &format!(
                        "unknown type '{}' (string, integer, number, boolean, null, array, object)",
                        other.chars().take(32).collect::<String>()
                    ),
                ))
            }
        };
        self.push(node, path)
    }

    fn object(
        &mut self,
        o: &Map<String, Value>,
        props: &Value,
        path: &str,
        depth: usize,
    ) -> Result<NodeId> {
        let Value::Object(props) = props else {
            return Err(invalid(path, "'properties' must be an object"));
        };
        if props.len() > MAX_CHOICES {
            return Err(invalid(
                path,
                &format!("an object may list at most {MAX_CHOICES} properties"),
            ));
        }
        let required: Vec<&str> = match o.get("required") {
            None => Vec::new(),
            Some(Value::Array(r)) => r
                .iter()
                .map(|k| {
                    k.as_str()
                        .ok_or_else(|| invalid(path, "'required' must list names"))
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(invalid(path, "'required' must be an array of names")),
        };
        if let Some(k) = required.iter().find(|k| !props.contains_key(**k)) {
            return Err(invalid(
                path,
                &format!(
                    "'required' names '{}', which 'properties' does not list",
                    k.chars().take(64).collect::<String>()
                ),
            ));
        }
        let slot = self.push(Node::Pending, path)?;
        let mut out = Vec::with_capacity(props.len());
        for (name, s) in props {
            let key: Box<[u8]> = serde_json::to_vec(&Value::String(name.clone()))
                .unwrap_or_default()
                .into();
            if key.len() > MAX_LITERAL_BYTES {
                return Err(invalid(
                    path,
                    &format!("property names may be at most {MAX_LITERAL_BYTES} bytes as JSON"),
                ));
            }
            let node = self.compile(
                s,
                &format!("{path}/properties/{}", pointer_escape(name)),
                depth + 1,
            )?;
            out.push(Prop {
                key,
                node,
                required: required.contains(&name.as_str()),
            });
        }
        self.nodes[slot as usize] = Node::Object(out);
        Ok(slot)
    }

    /// Compile a regular expression into a [`Pattern`]: regex-automata's dense DFA, walked
    /// from its anchored start over the bytes a JSON string may hold raw (no control bytes,
    /// `"` or `\`), keeping only states from which a match can still be reached.
    fn pattern(&mut self, regex: &str, path: &str) -> Result<u16> {
        use regex_automata::dfa::{dense, Automaton, StartKind};
        use regex_automata::nfa::thompson;
        use regex_automata::{util::start, Anchored, MatchKind};
        if self.patterns.len() >= MAX_PATTERNS {
            return Err(invalid(
                path,
                &format!("a schema may hold at most {MAX_PATTERNS} patterns / formats"),
            ));
        }
        let too_big = || {
            invalid(
                path,
                &format!(
                    "the patterns / formats need more than {MAX_PATTERN_STATES} automaton states"
                ),
            )
        };
        let raw = |b: u8| b >= 0x20 && b != b'"' && b != b'\\';
        // Bytes a raw string never holds stop the determinization (quit), so that the DFA's
        // budget goes to the bytes walked; the NFA is bounded too (a repetition count copies).
        let config = (0..=255u8)
            .filter(|&b| !raw(b))
            .fold(dense::Config::new(), |c, b| c.quit(b, true))
            .match_kind(MatchKind::All)
            .start_kind(StartKind::Anchored)
            .dfa_size_limit(Some(2 << 20))
            .determinize_size_limit(Some(2 << 20));
        let dfa = dense::Builder::new()
            .configure(config)
            .thompson(thompson::Config::new().nfa_size_limit(Some(4 << 20)))
            .build(regex)
            .map_err(|e| invalid(path, &format!("'pattern' / 'format': {e}")))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| invalid(path, &format!("'pattern' / 'format': {e}")))?;
        // Breadth first from the start: the DFA's states as 0, 1, 2, ...
        let mut index: HashMap<regex_automata::util::primitives::StateID, u32> = HashMap::new();
        let mut order = vec![start];
        index.insert(start, 0);
        let mut edges: Vec<u32> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let s = order[i];
            for b in 0..=255u8 {
                let t = dfa.next_state(s, b);
                if !raw(b) || dfa.is_dead_state(t) || dfa.is_quit_state(t) {
                    edges.push(Pattern::DEAD);
                    continue;
                }
                let n = order.len() as u32;
                let id = *index.entry(t).or_insert_with(|| {
                    order.push(t);
                    n
                });
                edges.push(id);
            }
            if self.pattern_states + order.len() > MAX_PATTERN_STATES {
                return Err(too_big());
            }
            i += 1;
        }
        let accept: Vec<bool> = order
            .iter()
            .map(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
            .collect();
        // Live states reach an accepting one (backwards from those, over reversed edges);
        // edges into the others are cut.
        let mut into: Vec<Vec<u32>> = vec![Vec::new(); order.len()];
        for (k, &t) in edges.iter().enumerate() {
            if t != Pattern::DEAD {
                into[t as usize].push((k / 256) as u32);
            }
        }
        let mut live = accept.clone();
        let mut work: Vec<u32> = (0..order.len() as u32)
            .filter(|&s| live[s as usize])
            .collect();
        while let Some(t) = work.pop() {
            for &s in &into[t as usize] {
                if !live[s as usize] {
                    live[s as usize] = true;
                    work.push(s);
                }
            }
        }
        if !live[0] {
            return Err(invalid(
                path,
                "no JSON string Arbor can write matches the 'pattern' (strings under a \
                 pattern hold no escapes: no '\"', '\\' or control characters)",
            ));
        }
        for t in edges.iter_mut() {
            if *t != Pattern::DEAD && !live[*t as usize] {
                *t = Pattern::DEAD;
            }
        }
        self.pattern_states += order.len();
        self.patterns.push(Pattern {
            next: edges,
            accept,
        });
        Ok((self.patterns.len() - 1) as u16)
    }

    fn literals(&mut self, values: &[Value], path: &str) -> Result<NodeId> {
        if values.is_empty() || values.len() > MAX_CHOICES {
            return Err(invalid(
                path,
                &format!("'enum' must hold 1 to {MAX_CHOICES} values"),
            ));
        }
        let mut out: Vec<Box<[u8]>> = Vec::with_capacity(values.len());
        for v in values {
            let text = serde_json::to_vec(v).unwrap_or_default();
            if text.len() > MAX_LITERAL_BYTES {
                return Err(invalid(
                    path,
                    &format!(
                        "'enum' / 'const' values may be at most {MAX_LITERAL_BYTES} bytes as JSON"
                    ),
                ));
            }
            if !out.iter().any(|o| **o == text[..]) {
                out.push(text.into());
            }
        }
        self.push(Node::Literals(out), path)
    }

    /// `#`, `#/$defs/NAME` or `#/definitions/NAME`, compiled once (recursion allowed: the
    /// target's node is reserved before its body is compiled).
    fn reference(&mut self, r: &Value, path: &str, depth: usize) -> Result<NodeId> {
        let Value::String(r) = r else {
            return Err(invalid(path, "'$ref' must be a string"));
        };
        if let Some(&id) = self.refs.get(r) {
            return Ok(id);
        }
        let target = if r == "#" {
            Some(self.root)
        } else {
            ["#/$defs/", "#/definitions/"].iter().find_map(|prefix| {
                let name = r.strip_prefix(prefix)?;
                let name = name.replace("~1", "/").replace("~0", "~");
                self.root.get(&prefix[2..prefix.len() - 1])?.get(name)
            })
        };
        let Some(target) = target else {
            return Err(invalid(
                path,
                &format!(
                    "'$ref' '{}' does not name '#', '#/$defs/NAME' or '#/definitions/NAME' of \
                     this schema",
                    r.chars().take(64).collect::<String>()
                ),
            ));
        };
        // The reference is a one-option union: its node exists before the target compiles.
        let slot = self.push(Node::Pending, path)?;
        self.refs.insert(r.clone(), slot);
        let body = self.compile(target, r, depth + 1)?;
        self.nodes[slot as usize] = Node::Union(vec![body]);
        Ok(slot)
    }
}

/// Most patterns / formats of one schema, and states of all their automata (each 1 KiB).
const MAX_PATTERNS: usize = 64;
const MAX_PATTERN_STATES: usize = 16_384;

/// An RFC 3339 `full-date`: days by month, February 29th in leap years only.
macro_rules! date {
    () => {
        concat!(
            r"([0-9]{4}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])",
            r"|[0-9]{4}-(0[469]|11)-(0[1-9]|[12][0-9]|30)",
            r"|[0-9]{4}-02-(0[1-9]|1[0-9]|2[0-8])",
            r"|([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29)"
        )
    };
}

/// An RFC 3339 `full-time` (the offset required; no leap second, `T` and `Z` upper case).
macro_rules! time {
    () => {
        r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
    };
}

/// A DNS label: 1 to 63 letters, digits and inner hyphens.
macro_rules! label {
    () => {
        r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    };
}

/// The `format`s supported, as regular expressions over the whole string: RFC 3339 dates and
/// times, RFC 4122 UUIDs, dotted IPv4, e-mail addresses as a dot-atom at a domain of DNS labels
/// (RFC 5322's common form), host names of DNS labels, URIs as a scheme and RFC 3986's
/// characters.
const FORMATS: &[(&str, &str)] = &[
    ("date", concat!("^", date!(), "$")),
    ("time", concat!("^", time!(), "$")),
    ("date-time", concat!("^", date!(), "T", time!(), "$")),
    (
        "uuid",
        r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    ),
    (
        "ipv4",
        r"^(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3}$",
    ),
    (
        "email",
        concat!(
            r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@",
            label!(),
            r"(\.",
            label!(),
            r")+$"
        ),
    ),
    ("hostname", concat!("^", label!(), r"(\.", label!(), ")*$")),
    (
        "uri",
        r"^[A-Za-z][A-Za-z0-9+.-]*:([A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})+$",
    ),
];

fn format_regex(name: &str) -> Option<&'static str> {
    FORMATS.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
}

/// Whether `v` is of JSON schema type `t`.
fn is_type(v: &Value, t: &str) -> bool {
    match t {
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        _ => false,
    }
}

/// Per node, the fewest schema frames a value of it opens: an object one plus what its
/// required properties need, an array one plus what an item needs where it must hold one, a
/// union what its cheapest option needs (a fixpoint from "none finite", so recursion
/// settles; `u16::MAX` stays where no finite value exists).
fn frames_needed(nodes: &[Node]) -> Vec<u16> {
    let mut need = vec![u16::MAX; nodes.len()];
    loop {
        let mut changed = false;
        for (id, n) in nodes.iter().enumerate() {
            let v = match n {
                Node::Any
                | Node::AnyObject
                | Node::String { .. }
                | Node::Number { .. }
                | Node::Literals(_) => 0,
                Node::Object(props) => props
                    .iter()
                    .filter(|p| p.required)
                    .map(|p| need[p.node as usize])
                    .max()
                    .unwrap_or(0)
                    .saturating_add(1),
                Node::Array { items, min, .. } => {
                    (if *min > 0 { need[*items as usize] } else { 0 }).saturating_add(1)
                }
                Node::Union(opts) => opts
                    .iter()
                    .map(|&o| need[o as usize])
                    .min()
                    .unwrap_or(u16::MAX),
                Node::Pending => u16::MAX,
            };
            if v < need[id] {
                need[id] = v;
                changed = true;
            }
        }
        if !changed {
            return need;
        }
    }
}

/// A property name as a JSON pointer segment (for error paths).
fn pointer_escape(name: &str) -> String {
    name.chars()
        .take(64)
        .collect::<String>()
        .replace('~', "~0")
        .replace('/', "~1")
}

/// The bytes a value of node `id` can start with (memoized in `first`; `visiting` marks the
/// unions on the way: one reached again before a byte is read is an error).
fn first_bytes(
    nodes: &[Node],
    id: usize,
    first: &mut [Option<[u64; 4]>],
    visiting: &mut [bool],
) -> Result<[u64; 4]> {
    if let Some(f) = first[id] {
        return Ok(f);
    }
    let mut set = [0u64; 4];
    let mut add = |b: u8| set[b as usize / 64] |= 1 << (b % 64);
    match &nodes[id] {
        Node::Any => b"{[\"-0123456789tfn".iter().for_each(|&b| add(b)),
        Node::AnyObject | Node::Object(_) => add(b'{'),
        Node::Array { .. } => add(b'['),
        Node::String { .. } => add(b'"'),
        Node::Number { .. } => b"-0123456789".iter().for_each(|&b| add(b)),
        Node::Literals(v) => v.iter().for_each(|l| add(l[0])),
        Node::Pending => {}
        Node::Union(opts) => {
            if visiting[id] {
                return Err(invalid(
                    "#",
                    "a '$ref' / anyOf cycle reaches itself before any text is read",
                ));
            }
            visiting[id] = true;
            for &o in opts {
                let f = first_bytes(nodes, o as usize, first, visiting)?;
                for (s, w) in set.iter_mut().zip(f) {
                    *s |= w;
                }
            }
            visiting[id] = false;
        }
    }
    first[id] = Some(set);
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::json::tests::{random_pieces, xorshift};
    use crate::sample::json::{JsonConstraint, JsonState, JsonVocab};
    use serde_json::json;

    /// Whether `text` is a complete text of `g`.
    fn accepts(g: &JsonGrammar, text: &str) -> bool {
        JsonState::start(g)
            .after(g, text.as_bytes())
            .is_some_and(|s| s.is_done())
    }

    /// An independent check of `v` against the subset (keys in the schema's order).
    fn conforms(v: &Value, s: &Value, root: &Value) -> bool {
        let Some(o) = s.as_object() else {
            return s == &Value::Bool(true);
        };
        if let Some(r) = o.get("$ref").and_then(Value::as_str) {
            let t = match r.strip_prefix("#/$defs/") {
                Some(name) => &root["$defs"][name],
                None => root,
            };
            return conforms(v, t, root);
        }
        if let Some(opts) = o.get("anyOf").or(o.get("oneOf")).and_then(Value::as_array) {
            return opts.iter().filter(|s| conforms(v, s, root)).count() == 1;
        }
        if let Some(e) = o.get("enum").and_then(Value::as_array) {
            return e.contains(v);
        }
        if let Some(c) = o.get("const") {
            return c == v;
        }
        let types: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t],
            Some(Value::Array(t)) => t.iter().filter_map(Value::as_str).collect(),
            _ if o.contains_key("properties") => vec!["object"],
            _ if o.contains_key("items") => vec!["array"],
            _ => return true,
        };
        let n = |k: &str, d: u64| o.get(k).and_then(Value::as_u64).unwrap_or(d) as usize;
        types.iter().any(|&t| match (t, v) {
            ("string", Value::String(x)) => {
                let re = match (o.get("pattern"), o.get("format")) {
                    (Some(p), _) => p.as_str().map(str::to_string),
                    (_, Some(f)) => {
                        format_regex(f.as_str().unwrap_or_default()).map(str::to_string)
                    }
                    _ => None,
                };
                (n("minLength", 0)..=n("maxLength", u64::MAX)).contains(&x.chars().count())
                    && re
                        .is_none_or(|re| fancy_regex::Regex::new(&re).unwrap().is_match(x).unwrap())
            }
            ("integer", Value::Number(x)) => x.is_i64() || x.is_u64(),
            ("number", Value::Number(_)) => true,
            ("boolean", Value::Bool(_)) => true,
            ("null", Value::Null) => true,
            ("array", Value::Array(a)) => {
                (n("minItems", 0)..=n("maxItems", u64::MAX)).contains(&a.len())
                    && a.iter()
                        .all(|x| conforms(x, o.get("items").unwrap_or(&json!(true)), root))
            }
            ("object", Value::Object(m)) => {
                let Some(props) = o.get("properties").and_then(Value::as_object) else {
                    return true;
                };
                let req: Vec<&str> = o
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let order: Vec<usize> = m
                    .keys()
                    .filter_map(|k| props.keys().position(|p| p == k))
                    .collect();
                order.len() == m.len()
                    && order.windows(2).all(|w| w[0] < w[1])
                    && req.iter().all(|k| m.contains_key(*k))
                    && m.iter().all(|(k, x)| conforms(x, &props[k], root))
            }
            _ => false,
        })
    }

    fn person() -> Value {
        json!({
            "title": "Person",
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "age": {"type": "integer"},
                "height": {"type": "number", "description": "metres"},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
                "kind": {"enum": ["a", "ab", 1, 12, null]},
                "ok": {"type": "boolean"},
                "nick": {"type": ["string", "null"]},
                "pet": {"anyOf": [{"$ref": "#/$defs/pet"}, {"type": "null"}]},
                "extra": {},
                "when": {"type": "string", "format": "date"},
                "v": {"const": "1.0"}
            },
            "required": ["name", "age", "ok", "v"],
            "$defs": {
                "pet": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}
                    },
                    "required": ["name"]
                }
            }
        })
    }

    #[test]
    fn schemas_accept_exactly_their_instances() {
        let schema = person();
        let g = JsonGrammar::from_schema(&schema).unwrap();
        let good = [
            r#"{"name": "Ada", "age": 36, "ok": true, "v": "1.0"}"#,
            r#"{"name":"é","age":-1,"height":1.5e0,"tags":["x","y"],"kind":12,"ok":false,"nick":null,"pet":{"name":"Rex","kids":[{"name":"P","kids":[]}]},"extra":{"any":[1,{"k":null}]},"v":"1.0"}"#,
            r#"{"name": "12345678", "age": 0, "kind": 1, "ok": true, "nick": "x", "pet": null, "extra": "s", "v": "1.0"}"#,
            r#"{"name": "\u00e9\n", "age": 7, "kind": "ab", "ok": true, "v": "1.0"} "#,
            r#"{"name": "a", "age": 1, "kind": "a", "ok": false, "extra": 3, "when": "2024-02-29", "v": "1.0"}"#,
        ];
        for t in good {
            assert!(accepts(&g, t), "{t}");
            let v: Value = serde_json::from_str(t).unwrap();
            assert!(conforms(&v, &schema, &schema), "{t}");
        }
        let bad = [
            // Required properties missing, out of order, unknown, twice.
            r#"{"name": "Ada", "ok": true, "v": "1.0"}"#,
            r#"{"age": 36, "name": "Ada", "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "v": "1.0", "x": 1}"#,
            // Types and bounds.
            r#"{"name": "", "age": 36, "ok": true, "v": "1.0"}"#,
            r#"{"name": "123456789", "age": 36, "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 3.5, "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 1e3, "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": "36", "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "tags": [], "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "tags": ["a","b","c"], "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "kind": "b", "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "kind": 2, "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "kind": 123, "ok": true, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": null, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "nick": 1, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "pet": {}, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "pet": {"name": "R", "kids": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}, "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "v": "1.1"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "when": "2024-13-01", "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "when": "2024-1-01", "v": "1.0"}"#,
            r#"{"name": "Ada", "age": 36, "ok": true, "v": "1.0""#,
            r#"[]"#,
        ];
        for t in bad {
            assert!(!accepts(&g, t), "{t}");
            if let Ok(v) = serde_json::from_str::<Value>(t) {
                assert!(!conforms(&v, &schema, &schema), "{t}");
            }
        }
        // A property twice (serde_json keeps the last one).
        assert!(!accepts(
            &g,
            r#"{"name": "Ada", "name": "B", "age": 36, "ok": true, "v": "1.0"}"#
        ));
        // Arrays at the root, bounded; objects without properties hold anything.
        let g = JsonGrammar::from_schema(
            &json!({"type": "array", "items": {"type": "object"}, "maxItems": 1}),
        )
        .unwrap();
        assert!(accepts(&g, r#"[{"a": [1]}]"#));
        assert!(accepts(&g, "[]"));
        assert!(!accepts(&g, "[{}, {}]"));
        assert!(!accepts(&g, "[1]"));
        // `maxItems: 0` holds no item; no properties and no others is `{}`; a root of either
        // kind; integral bounds written as floats.
        let g = JsonGrammar::from_schema(&json!({"type": "object", "properties": {"a": {"type": "array", "maxItems": 0}, "b": {"type": "object", "additionalProperties": false}}})).unwrap();
        assert!(accepts(&g, r#"{"a": [], "b": {}}"#));
        assert!(!accepts(&g, r#"{"a": [1]}"#));
        assert!(!accepts(&g, r#"{"b": {"x": 1}}"#));
        let g = JsonGrammar::from_schema(&json!({"type": ["object", "array"], "minItems": 2.0}))
            .unwrap();
        assert!(accepts(&g, r#"{"x": 1}"#));
        assert!(accepts(&g, "[1, 2]"));
        assert!(!accepts(&g, "[1]"));
        // Equal schema texts, equal grammars; JSON mode is its own.
        assert_eq!(
            JsonGrammar::from_schema(&person()).unwrap(),
            JsonGrammar::from_schema(&schema).unwrap()
        );
        assert_ne!(
            *JsonGrammar::any_object(),
            JsonGrammar::from_schema(&schema).unwrap()
        );
    }

    #[test]
    fn unsupported_schemas_are_refused_with_a_reason() {
        let cases = [
            (
                json!({"type": "object", "patternProperties": {"^a": {}}}),
                "'patternProperties'",
            ),
            (
                json!({"type": "object", "properties": {"d": {"type": "string", "format": "ipv6"}}}),
                "'format' 'ipv6'",
            ),
            (
                json!({"type": "object", "additionalProperties": {"type": "integer"}}),
                "additionalProperties",
            ),
            (
                json!({"type": "object", "properties": {}, "additionalProperties": true}),
                "additionalProperties",
            ),
            (
                json!({"type": "object", "properties": {"n": {"type": ["integer", "number"]}}}),
                "start differently",
            ),
            (
                json!({"type": "object", "properties": {"n": {"anyOf": [{"enum": ["a"]}, {"type": "string"}]}}}),
                "start differently",
            ),
            (
                json!({"type": "object", "properties": {"n": {"$ref": "#/$defs/missing"}}}),
                "'$ref'",
            ),
            (
                json!({"type": "object", "properties": {"n": {"$ref": "https://x/y"}}}),
                "'$ref'",
            ),
            (
                json!({"type": "object", "properties": {"n": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}}),
                "cycle",
            ),
            (json!({"type": "string"}), "root"),
            (
                json!({"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 2}}}),
                "above",
            ),
            (
                json!({"type": "object", "properties": {"a": {}}, "required": ["b"]}),
                "'required'",
            ),
            (
                json!({"type": "object", "properties": {"a": {"enum": []}}}),
                "'enum'",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "date"}}}),
                "unknown type",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}),
                "'minimum'",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "prefixItems": []}}}),
                "'prefixItems'",
            ),
            (
                json!({"type": "object", "properties": {"a": false}}),
                "must be an object",
            ),
        ];
        for (schema, want) in cases {
            let e = JsonGrammar::from_schema(&schema).unwrap_err();
            assert_eq!(e.error_type(), "invalid_argument");
            assert!(e.to_string().contains(want), "{schema}: {e}");
        }
        // Review findings: refused, and in time (no loop, no deep recursion).
        let mut chain = Map::new();
        for i in 0..2000 {
            chain.insert(
                format!("a{i}"),
                json!({"$ref": format!("#/$defs/a{}", i + 1)}),
            );
        }
        chain.insert("a2000".into(), json!({"type": "object"}));
        let refused = [
            (json!({"$ref": "#"}), "cycle"),
            (json!({"anyOf": [{"$ref": "#"}]}), "cycle"),
            (
                json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
                "cycle",
            ),
            (
                json!({"$ref": "#/$defs/a0", "$defs": chain}),
                "more than 64 deep",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
                "nests more than 16",
            ),
            (
                json!({"type": "object", "properties": {"p": {"$ref": "#/$defs/P", "required": ["x"]}}, "$defs": {"P": {"type": "object"}}}),
                "'required' cannot sit beside '$ref'",
            ),
            (
                json!({"type": "object", "properties": {"s": {"type": "string", "enum": [1]}}}),
                "not of the schema's 'type'",
            ),
            (
                json!({"type": "object", "properties": {"s": {"enum": ["a", "b"], "const": "a"}}}),
                "'const' cannot sit beside 'enum'",
            ),
            (
                json!({"type": "object", "properties": {"s": {"enum": ["a"], "minLength": 3}}}),
                "'minLength' cannot sit beside 'enum'",
            ),
            (
                json!({"type": "object", "properties": {"s": {"minLength": 3}}}),
                "'minLength' needs a 'type'",
            ),
            (
                json!({"type": "object", "properties": {"s": {"type": "string", "maxLength": 70000}}}),
                "below 65535",
            ),
            (
                json!({"type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "number"}]}}}),
                "#/properties/n: the options",
            ),
        ];
        for (schema, want) in refused {
            let e = JsonGrammar::from_schema(&schema).unwrap_err();
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        let many: Map<String, Value> = (0..=MAX_CHOICES)
            .map(|i| (format!("p{i}"), json!({})))
            .collect();
        let e =
            JsonGrammar::from_schema(&json!({"type": "object", "properties": many})).unwrap_err();
        assert!(e.to_string().contains("at most 64 properties"), "{e}");
    }

    /// Random vocabulary pieces: the masks of the schema states along an instance equal each
    /// token tried on its own (string states with and without counts, keys, literals).
    #[test]
    fn schema_masks_equal_a_token_by_token_check() {
        let text = r#"{"name": "é\nnamet", "age": -10, "tags": ["a"], "kind": 12, "ok": true, "pet": {"name": "d", "kids": []}, "extra": [1], "when": "1999-12-31", "v": "1.0"}"#;
        let mut pieces = random_pieces(
            b"{}[]\":, \n0123456789-.enamgtkisdufl\\\xC3\xA9",
            0x2545_F491_4F6C_DD1D,
        );
        pieces.extend(text.bytes().map(|b| Some(vec![b])));
        let vocab = Arc::new(JsonVocab::new(pieces.clone(), vec![]));
        let g = Arc::new(JsonGrammar::from_schema(&person()).unwrap());
        let mut c = JsonConstraint::new(Arc::clone(&vocab), Arc::clone(&g), &[], 0, false);
        let byte_tokens: Vec<u32> = text
            .bytes()
            .map(|b| {
                pieces
                    .iter()
                    .position(|p| p.as_deref() == Some(&[b][..]))
                    .unwrap() as u32
            })
            .collect();
        let mut checked = 0;
        for &t in &byte_tokens {
            let state = c.state().unwrap();
            let mut row = vec![0.0f32; pieces.len()];
            c.mask_row(&mut row, &[]);
            for (id, p) in pieces.iter().enumerate() {
                let want = state.after(&g, p.as_deref().unwrap()).is_some();
                assert_eq!(row[id] == 0.0, want, "{state:?} {p:?}");
                checked += want as usize;
            }
            c.push(t);
        }
        assert!(c.state().is_some_and(|s| s.is_done()));
        assert!(checked > 1000, "{checked}");
    }

    /// `pattern` (matched anywhere in the string, as JSON Schema does, unless anchored) and
    /// the supported `format`s, with length bounds beside them; no escapes under a pattern;
    /// patterns that cannot match, do not parse or need what the DFA lacks are refused.
    #[test]
    fn patterns_and_formats_constrain_strings() {
        let g = JsonGrammar::from_schema(&json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,3}$"},
                "code": {"type": "string", "pattern": "[0-9]{3}"},
                "at": {"type": "string", "format": "date-time"},
                "id": {"type": "string", "format": "uuid"},
                "mail": {"type": "string", "format": "email"},
                "ip": {"type": "string", "format": "ipv4"},
                "day": {"type": "string", "format": "date"},
                "t": {"type": "string", "format": "time"},
                "host": {"type": "string", "format": "hostname"},
                "uri": {"type": "string", "format": "uri"}
            }
        }))
        .unwrap();
        let one = |k: &str, v: &str| accepts(&g, &format!(r#"{{"{k}": "{v}"}}"#));
        for (k, v) in [
            ("name", "Ada"),
            ("name", "Abcd"),
            ("code", "ab123cd"),
            ("code", "123"),
            ("code", "é999"),
            ("at", "2024-02-29T12:30:00Z"),
            ("at", "2000-02-29T23:59:59.25+05:30"),
            ("day", "2023-04-30"),
            ("id", "123e4567-e89b-12d3-a456-426614174000"),
            ("mail", "a.b+c@ex-ample.co.uk"),
            ("ip", "192.168.0.1"),
            ("ip", "255.0.10.9"),
            ("day", "1999-12-31"),
            ("t", "00:00:00-01:00"),
            ("host", "a-b.example"),
            ("uri", "https://example.com/a?b=c#d"),
        ] {
            assert!(one(k, v), "{k}: {v}");
        }
        for (k, v) in [
            ("name", "ada"),
            ("name", "A"),
            ("name", "Abcde"),
            ("name", "A\\u0062c"),
            ("code", "12a3"),
            ("at", "2024-02-29 12:30:00Z"),
            ("at", "2024-02-29T12:30:00"),
            ("at", "2024-02-29T24:00:00Z"),
            ("at", "2024-02-29t12:30:00Z"),
            ("at", "2024-02-29T12:30:60Z"),
            ("day", "2023-02-29"),
            ("day", "1900-02-29"),
            ("day", "2024-04-31"),
            ("mail", ".a@b.co"),
            ("mail", "a..b@b.co"),
            ("mail", "a@-b.co"),
            ("uri", "x:<>"),
            ("uri", "x:%zz"),
            ("id", "123e4567-e89b-12d3-a456-42661417400"),
            ("mail", "a@b"),
            ("mail", "@b.com"),
            ("ip", "256.1.1.1"),
            ("ip", "01.1.1.1"),
            ("day", "1999-00-10"),
            ("t", "12:60:00Z"),
            ("host", "-a.example"),
            ("uri", "no scheme"),
        ] {
            assert!(!one(k, v), "{k}: {v}");
        }
        let refused = [
            (
                json!({"type": "string", "pattern": "a", "format": "date"}),
                "'pattern' beside 'format'",
            ),
            (json!({"type": "string", "pattern": "([a-z"}), "'pattern'"),
            (json!({"type": "string", "pattern": "a(?=b)"}), "'pattern'"),
            (
                json!({"type": "string", "pattern": "^\"$"}),
                "no JSON string",
            ),
            (
                json!({"type": "string", "pattern": r"^a\\b$"}),
                "no JSON string",
            ),
            (
                json!({"type": "string", "format": "ipv6"}),
                "'format' 'ipv6' is not supported",
            ),
            (
                json!({"type": "string", "pattern": "a{2000000000}"}),
                "'pattern'",
            ),
            (
                json!({"type": "string", "format": "date", "maxLength": 5}),
                "beside 'pattern' / 'format'",
            ),
            (json!({"type": "string", "pattern": 3}), "must be a string"),
        ];
        for (s, want) in refused {
            let schema = json!({"type": "object", "properties": {"s": s}});
            let e = JsonGrammar::from_schema(&schema).unwrap_err();
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
    }

    /// The state after `level` repeated as often as the grammar takes it, and how often.
    fn deepest(g: &JsonGrammar, level: &[u8]) -> (JsonState, usize) {
        let mut s = JsonState::start(g);
        let mut levels = 0;
        while let Some(next) = s.after(g, level) {
            s = next;
            levels += 1;
        }
        (s, levels)
    }

    /// A recursive schema nests as deep as the automaton's frames allow and no deeper: an
    /// optional property or item that would not fit is not offered, so every state reached can
    /// still be completed.
    #[test]
    fn recursion_stops_where_the_frames_end() {
        let tree = json!({
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
            },
            "required": ["v"]
        });
        let g = JsonGrammar::from_schema(&tree).unwrap();
        let level = br#"{"v":1,"kids":["#;
        let (s, levels) = deepest(&g, level);
        // Each level opens an object and an array: the seventh one's item is the 15th frame;
        // an eighth level's array would leave its item no frame.
        assert_eq!(levels, 7);
        let inner = s.after(&g, br#"{"v":1"#).unwrap();
        assert!(inner.after(&g, br#","kids""#).is_none());
        let closed = inner.after(&g, format!("}}{}", "]}".repeat(7)).as_bytes());
        assert!(closed.is_some_and(|s| s.is_done()));
        // The same through the masks: every state along the way allows a token.
        let pieces: Vec<Option<Vec<u8>>> = (0x20u8..0x7F).map(|b| Some(vec![b])).collect();
        let vocab = Arc::new(JsonVocab::new(pieces, vec![]));
        let mut c = JsonConstraint::new(vocab, Arc::new(g), &[], 0, false);
        let text = format!(
            "{}{{\"v\":1}}{}",
            std::str::from_utf8(level).unwrap().repeat(7),
            "]}".repeat(7)
        );
        for b in text.bytes() {
            let mut row = vec![0.0f32; 95];
            c.mask_row(&mut row, &[]);
            assert!(row.contains(&0.0));
            assert_eq!(row[(b - 0x20) as usize], 0.0, "{}", b as char);
            c.push((b - 0x20) as u32);
        }
        assert!(c.state().is_some_and(|s| s.is_done()));
        // A union picks its option by the first byte: an object that would not fit is
        // refused where `null` still does (a list whose objects each open an array too).
        let list = json!({
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "integer"}},
                "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}
            },
            "required": ["tags", "next"]
        });
        let g = JsonGrammar::from_schema(&list).unwrap();
        let (s, levels) = deepest(&g, br#"{"tags":[],"next":"#);
        // The 15th object's `next` would need two frames more.
        assert_eq!(levels, 15);
        assert!(s.after(&g, b"{").is_none());
        let closed = s.after(&g, format!("null{}", "}".repeat(15)).as_bytes());
        assert!(closed.is_some_and(|s| s.is_done()));
    }

    /// A request's schema compiles once and its clones share it; a schema sent again (same
    /// text) reuses the process's compiled grammar, a refused one its refusal; property order
    /// tells schemas apart.
    #[test]
    fn schemas_compile_once_per_text() {
        let a = Arc::new(JsonSchema::new(person()));
        let g = a.grammar().unwrap();
        assert!(Arc::ptr_eq(&g, &Arc::clone(&a).grammar().unwrap()));
        assert!(Arc::ptr_eq(
            &g,
            &JsonSchema::new(person()).grammar().unwrap()
        ));
        let bad = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}});
        let e1 = JsonSchema::new(bad.clone()).grammar().unwrap_err();
        let e2 = JsonSchema::new(bad).grammar().unwrap_err();
        assert_eq!(e1.to_string(), e2.to_string());
        assert!(e1.to_string().contains("'minimum'"), "{e1}");
        let ab = JsonSchema::new(json!({"type": "object", "properties": {"a": {}, "b": {}}}));
        let ba = JsonSchema::new(json!({"type": "object", "properties": {"b": {}, "a": {}}}));
        assert_ne!(ab, ba);
        assert!(!Arc::ptr_eq(&ab.grammar().unwrap(), &ba.grammar().unwrap()));
    }

    /// Grammars whose nodes are numbered alike share a vocabulary, not their masks.
    #[test]
    fn grammars_do_not_share_masks() {
        let pieces: Vec<Option<Vec<u8>>> = ["[", "1", "\"", "]"]
            .iter()
            .map(|p| Some(p.as_bytes().to_vec()))
            .collect();
        let vocab = Arc::new(JsonVocab::new(pieces, vec![]));
        let allowed = |items: &str| {
            let schema = json!({"type": "array", "items": {"type": items}});
            let g = Arc::new(JsonGrammar::from_schema(&schema).unwrap());
            let mut c = JsonConstraint::new(Arc::clone(&vocab), g, &[], 0, false);
            c.push(0);
            let mut row = vec![0.0f32; 4];
            c.mask_row(&mut row, &[]);
            (0..4).filter(|&i| row[i] == 0.0).collect::<Vec<_>>()
        };
        assert_eq!(allowed("integer"), [1, 3]);
        assert_eq!(allowed("string"), [2, 3]);
        assert_eq!(allowed("integer"), [1, 3]);
    }

    /// Random walks through the masks (a byte vocabulary and some longer pieces): every
    /// state allows a token, and every text that completes conforms to its schema.
    #[test]
    fn random_masked_walks_end_in_conforming_instances() {
        let mut pieces: Vec<Option<Vec<u8>>> = (0x20u8..0x7F)
            .chain([b'\n'])
            .map(|b| Some(vec![b]))
            .collect();
        for p in [
            "\"name\"",
            "\":",
            "\",",
            "{\"",
            "true",
            "null",
            "é",
            "12",
            ", \"",
            "\"}",
            "\"kids\": [",
            "]}",
        ] {
            pieces.push(Some(p.as_bytes().to_vec()));
        }
        pieces.push(None); // end of generation
        let end = pieces.len() as u32 - 1;
        let vocab = Arc::new(JsonVocab::new(pieces.clone(), vec![end]));
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let schemas = [
            person(),
            json!({"type": "array", "items": {"enum": ["x", 1, [2], {"k": false}]}, "minItems": 2, "maxItems": 3}),
            json!({"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 3}, "o": {"type": "object", "properties": {}}}, "required": ["o"]}),
            json!({"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-c]+-[0-9]{2}$"}, "q": {"type": "string", "pattern": "^[xyz]{1,3}$"}, "d": {"type": "string", "format": "date"}, "r": {"type": "string", "pattern": "^(x\"|y)$"}}, "required": ["p", "q", "d", "r"]}),
        ];
        for schema in schemas {
            let g = Arc::new(JsonGrammar::from_schema(&schema).unwrap());
            let mut completed = 0;
            for _ in 0..150 {
                let mut c = JsonConstraint::new(Arc::clone(&vocab), Arc::clone(&g), &[], 0, false);
                let mut text = Vec::new();
                for _ in 0..400 {
                    let mut row = vec![0.0f32; pieces.len()];
                    c.mask_row(&mut row, &[]);
                    let ok: Vec<u32> = (0..row.len() as u32)
                        .filter(|&t| row[t as usize] == 0.0)
                        .collect();
                    assert!(
                        !ok.is_empty() && ok.len() < row.len(),
                        "{schema}: {}",
                        String::from_utf8_lossy(&text)
                    );
                    // Structure more often than content, so that walks end.
                    let t = if ok.contains(&end) {
                        end
                    } else if next().is_multiple_of(3) {
                        ok[(next() % ok.len() as u64) as usize]
                    } else {
                        let structural: Vec<u32> = ok
                            .iter()
                            .copied()
                            .filter(|&t| {
                                pieces[t as usize]
                                    .as_ref()
                                    .is_some_and(|p| p.len() > 1 || b"{}[]\",:0tfn".contains(&p[0]))
                            })
                            .collect();
                        let from = if structural.is_empty() {
                            &ok
                        } else {
                            &structural
                        };
                        from[(next() % from.len() as u64) as usize]
                    };
                    if t == end {
                        // (A number past f64's range is JSON serde_json does not read.)
                        let Ok(v) = serde_json::from_slice::<Value>(&text) else {
                            let e = serde_json::from_slice::<Value>(&text).unwrap_err();
                            assert!(e.to_string().contains("number out of range"), "{e}");
                            break;
                        };
                        assert!(conforms(&v, &schema, &schema), "{schema}: {v}");
                        completed += 1;
                        break;
                    }
                    text.extend(pieces[t as usize].as_deref().unwrap());
                    c.push(t);
                }
            }
            assert!(
                completed > 30,
                "{schema}: {completed} of 150 walks completed"
            );
        }
    }
}
