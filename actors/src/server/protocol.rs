//! The line protocol: parsing client lines (checked field by field, each mistake its own code) and rendering events, stats and errors as lines (`docs/protocol.md`).

use std::sync::Arc;
use std::time::Duration;

use arbor_engine::sample::verify::VerifyMode;
use arbor_engine::{ChatMessage, JsonSchema, ResponseFormat, SamplingParams};
use serde_json::{json, Map, Value};

use crate::api::EngineInfo;
use crate::error::{codes, ServeError};
use crate::events::{Completion, EngineStats, Event, FinishReason, PromptScores};
use crate::request::{truncate, Input, Request, SpeculationRequest};

/// Longest accepted request id (bytes of a string id).
pub const MAX_ID_BYTES: usize = 256;

/// One parsed client line.
#[derive(Debug)]
pub enum ClientLine {
    Request {
        id: Value,
        stream: bool,
        /// Completions to sample from the prompt (`n`, 1 to [`MAX_CHOICES`]).
        n: usize,
        req: Box<Request>,
    },
    Cancel(Value),
    Health,
    Stats,
    Auth(String),
}

/// A line that could not be served, with the request id when it was readable.
#[derive(Debug)]
pub struct LineError {
    pub id: Option<Value>,
    pub error: ServeError,
}

/// Most completions (`n`) of one request line.
pub const MAX_CHOICES: usize = 64;

const REQUEST_FIELDS: [&str; 25] = [
    "id",
    "n",
    "prompt",
    "messages",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
    "response_format",
    "stream",
    "deadline_ms",
    "speculation",
];
const SPEC_FIELDS: [&str; 5] = ["draft", "tree", "budget", "adaptive", "verify"];

fn err(code: &'static str, message: impl Into<String>) -> ServeError {
    ServeError::new(code, message)
}

/// Parse one line (without its newline).
pub fn parse_line(bytes: &[u8]) -> Result<ClientLine, LineError> {
    let no_id = |error| LineError { id: None, error };
    let text = std::str::from_utf8(bytes).map_err(|e| {
        no_id(err(
            codes::INVALID_UTF8,
            format!(
                "the line is not UTF-8 (bad byte at offset {})",
                e.valid_up_to()
            ),
        ))
    })?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| no_id(err(codes::INVALID_JSON, format!("invalid JSON: {e}"))))?;
    let Value::Object(obj) = value else {
        return Err(no_id(err(
            codes::NOT_AN_OBJECT,
            "each line must be one JSON object",
        )));
    };
    for key in ["cancel", "health", "stats", "auth"] {
        if let Some(v) = obj.get(key) {
            if let Some(other) = obj.keys().find(|k| k.as_str() != key) {
                return Err(no_id(err(
                    codes::UNKNOWN_FIELD,
                    format!("a '{key}' line has no field '{}'", truncate(other)),
                )));
            }
            return control(key, v).map_err(no_id);
        }
    }
    let id = match obj.get("id") {
        None => return Err(no_id(err(codes::MISSING_FIELD, "a request needs an 'id'"))),
        Some(v) => check_id(v).map_err(no_id)?,
    };
    let with_id = |error| LineError {
        id: Some(id.clone()),
        error,
    };
    let (stream, n, req) = request(&obj).map_err(with_id)?;
    Ok(ClientLine::Request {
        id,
        stream,
        n,
        req: Box::new(req),
    })
}

fn control(key: &str, v: &Value) -> Result<ClientLine, ServeError> {
    match key {
        "cancel" => Ok(ClientLine::Cancel(check_id(v)?)),
        "auth" => match v {
            Value::String(s) => Ok(ClientLine::Auth(s.clone())),
            _ => Err(err(codes::INVALID_TYPE, "'auth' must be a string")),
        },
        _ => match v {
            Value::Bool(true) => Ok(if key == "health" {
                ClientLine::Health
            } else {
                ClientLine::Stats
            }),
            Value::Bool(false) => Err(err(
                codes::INVALID_ARGUMENT,
                format!("'{key}' must be true"),
            )),
            _ => Err(err(codes::INVALID_TYPE, format!("'{key}' must be true"))),
        },
    }
}

/// Ids are strings (at most 256 bytes) or integers.
fn check_id(v: &Value) -> Result<Value, ServeError> {
    match v {
        Value::String(s) if s.len() <= MAX_ID_BYTES => Ok(v.clone()),
        Value::String(_) => Err(err(
            codes::INVALID_ARGUMENT,
            format!("an id has at most {MAX_ID_BYTES} bytes"),
        )),
        Value::Number(n) if n.is_i64() || n.is_u64() => Ok(v.clone()),
        // An integer JSON cannot hold in 64 bits (read as a float): the right type, too large.
        Value::Number(n)
            if n.as_f64()
                .is_some_and(|f| f.is_finite() && f.fract() == 0.0) =>
        {
            Err(err(
                codes::INVALID_ARGUMENT,
                "an integer id must fit in 64 bits",
            ))
        }
        _ => Err(err(
            codes::INVALID_TYPE,
            "'id' must be a string or an integer",
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(field: &str, want: &str, v: &Value) -> ServeError {
    err(
        codes::INVALID_TYPE,
        format!("'{field}' must be {want}, not {}", type_name(v)),
    )
}

/// An integer field: a number with a fractional part is the wrong type (`invalid_type`), one
/// written as a float without one (`100.0`, as some encoders write integers) is that integer,
/// and one outside 0..=`max` is out of range (`invalid_argument`).
fn uint(field: &str, v: &Value, max: u64) -> Result<u64, ServeError> {
    let out_of_range = |n: &serde_json::Number| {
        err(
            codes::INVALID_ARGUMENT,
            format!("'{field}' must be an integer from 0 to {max}, got {n}"),
        )
    };
    match v {
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(x), _) if x <= max => Ok(x),
            (Some(_), _) => Err(out_of_range(n)),
            (None, Some(f)) if f.fract() != 0.0 => Err(wrong_type(field, "an integer", v)),
            // Integral floats are exact up to 2^53 (negative integers fall through).
            (None, Some(f)) if f >= 0.0 && f <= max as f64 && f <= (1u64 << 53) as f64 => {
                Ok(f as u64)
            }
            _ => Err(out_of_range(n)),
        },
        _ => Err(wrong_type(field, "an integer", v)),
    }
}

fn float(field: &str, v: &Value) -> Result<f64, ServeError> {
    v.as_f64().ok_or_else(|| wrong_type(field, "a number", v))
}

fn boolean(field: &str, v: &Value) -> Result<bool, ServeError> {
    v.as_bool().ok_or_else(|| wrong_type(field, "a boolean", v))
}

fn string<'v>(field: &str, v: &'v Value) -> Result<&'v str, ServeError> {
    v.as_str().ok_or_else(|| wrong_type(field, "a string", v))
}

fn strings(field: &str, v: &Value) -> Result<Vec<String>, ServeError> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|x| string(field, x).map(str::to_string))
            .collect(),
        _ => Err(wrong_type(field, "a string or an array of strings", v)),
    }
}

/// An array of token ids (their range in the vocabulary is checked on submission).
fn token_ids(field: &str, v: &Value) -> Result<Vec<u32>, ServeError> {
    match v {
        Value::Array(a) => a
            .iter()
            .map(|x| uint(field, x, u32::MAX as u64).map(|t| t as u32))
            .collect(),
        _ => Err(wrong_type(field, "an array of token ids", v)),
    }
}

fn request(obj: &Map<String, Value>) -> Result<(bool, usize, Request), ServeError> {
    if let Some(k) = obj.keys().find(|k| !REQUEST_FIELDS.contains(&k.as_str())) {
        return Err(err(
            codes::UNKNOWN_FIELD,
            format!(
                "unknown field '{}' (fields: {})",
                truncate(k),
                REQUEST_FIELDS.join(", ")
            ),
        ));
    }
    let input = match (obj.get("prompt"), obj.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(err(
                codes::INVALID_ARGUMENT,
                "give either 'prompt' or 'messages', not both",
            ))
        }
        (None, None) => {
            return Err(err(
                codes::MISSING_FIELD,
                "a request needs 'prompt' or 'messages'",
            ))
        }
        (Some(p), None) => Input::Prompt(string("prompt", p)?.to_string()),
        (None, Some(m)) => Input::Messages(messages(m)?),
    };
    let mut req = Request::new(input);
    let mut sampling = SamplingParams::default();
    let mut stream = true;
    let mut n = 1;
    for (k, v) in obj {
        match k.as_str() {
            "max_tokens" => req.max_tokens = uint(k, v, u32::MAX as u64)? as usize,
            "min_tokens" => req.min_tokens = uint(k, v, u32::MAX as u64)? as usize,
            "ignore_eos" => req.ignore_eos = boolean(k, v)?,
            "logprobs" => req.logprobs = boolean(k, v)?,
            "top_logprobs" => req.top_logprobs = uint(k, v, u32::MAX as u64)? as usize,
            "prompt_logprobs" => {
                req.prompt_logprobs = Some(uint(k, v, u32::MAX as u64)? as usize);
            }
            "temperature" => {
                let t = float(k, v)?;
                if !(0.0..=100.0).contains(&t) {
                    return Err(err(
                        codes::INVALID_ARGUMENT,
                        format!("'temperature' must be from 0 to 100, got {t}"),
                    ));
                }
                sampling.temperature = t as f32;
            }
            "top_p" => {
                let p = float(k, v)?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(err(
                        codes::INVALID_ARGUMENT,
                        format!("'top_p' must be in (0, 1], got {p}"),
                    ));
                }
                sampling.top_p = p as f32;
            }
            "top_k" => sampling.top_k = uint(k, v, u32::MAX as u64)? as usize,
            "min_p" => {
                let p = float(k, v)?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(err(
                        codes::INVALID_ARGUMENT,
                        format!("'min_p' must be in [0, 1], got {p}"),
                    ));
                }
                sampling.min_p = p as f32;
            }
            // Ranges: `Penalties::validate` at the edge (`ValidRequest`).
            "repetition_penalty" => req.penalties.repetition = float(k, v)? as f32,
            "frequency_penalty" => req.penalties.frequency = float(k, v)? as f32,
            "presence_penalty" => req.penalties.presence = float(k, v)? as f32,
            "logit_bias" => req.logit_bias = logit_bias(v)?,
            "seed" => sampling.seed = uint(k, v, u64::MAX)?,
            "stop" => req.stop = strings(k, v)?,
            "stop_token_ids" => req.stop_token_ids = token_ids(k, v)?,
            "response_format" => req.response_format = response_format(v)?,
            "stream" => stream = boolean(k, v)?,
            "n" => {
                n = uint(k, v, MAX_CHOICES as u64)? as usize;
                if n == 0 {
                    return Err(err(
                        codes::INVALID_ARGUMENT,
                        format!("'n' must be from 1 to {MAX_CHOICES}, got 0"),
                    ));
                }
            }
            "deadline_ms" => {
                let ms = uint(k, v, u32::MAX as u64)?;
                if ms == 0 {
                    return Err(err(
                        codes::INVALID_ARGUMENT,
                        "'deadline_ms' must be positive",
                    ));
                }
                req.deadline = Some(Duration::from_millis(ms));
            }
            "speculation" => req.speculation = Some(speculation(v)?),
            _ => {}
        }
    }
    req.sampling = sampling;
    Ok((stream, n, req))
}

/// `{"token id": bias, ...}` (OpenAI's shape: keys are decimal token ids) into (token, bias)
/// pairs; their values and ids are checked with the other settings
/// (`GenerateParams::validate`).
fn logit_bias(v: &Value) -> Result<Vec<(u32, f32)>, ServeError> {
    let Value::Object(o) = v else {
        return Err(wrong_type(
            "logit_bias",
            "an object of token id -> number",
            v,
        ));
    };
    let mut out = Vec::with_capacity(o.len());
    for (k, b) in o {
        let t: u32 = k.parse().map_err(|_| {
            err(
                codes::INVALID_ARGUMENT,
                format!("'logit_bias' keys must be token ids, got '{}'", truncate(k)),
            )
        })?;
        out.push((t, float("logit_bias", b)? as f32));
    }
    Ok(out)
}

/// OpenAI's `{"type": "text" | "json_object"}` and `{"type": "json_schema", "json_schema":
/// {"name", "description", "schema", "strict"}}` (the schema is compiled on submission: what
/// it holds that Arbor does not support is an `invalid_argument` naming it).
fn response_format(v: &Value) -> Result<ResponseFormat, ServeError> {
    let Value::Object(o) = v else {
        return Err(wrong_type("response_format", "an object", v));
    };
    let t = o
        .get("type")
        .ok_or_else(|| err(codes::MISSING_FIELD, "'response_format' needs a 'type'"))?;
    let (format, fields) = match string("response_format.type", t)? {
        "text" => (ResponseFormat::Text, &["type"][..]),
        "json_object" => (ResponseFormat::JsonObject, &["type"][..]),
        "json_schema" => {
            let spec = o.get("json_schema").ok_or_else(|| {
                err(
                    codes::MISSING_FIELD,
                    "'response_format' of type json_schema needs 'json_schema': {\"name\", \"schema\"}",
                )
            })?;
            (json_schema(spec)?, &["type", "json_schema"][..])
        }
        other => {
            return Err(err(
                codes::INVALID_ARGUMENT,
                format!(
                    "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", \
                     got '{}'",
                    truncate(other)
                ),
            ))
        }
    };
    if let Some(k) = o.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(err(
            codes::UNKNOWN_FIELD,
            format!(
                "'response_format' has no field '{}' ({})",
                truncate(k),
                fields.join(", ")
            ),
        ));
    }
    Ok(format)
}

/// `response_format.json_schema`: the schema compiled (`strict` is always on: outputs match
/// the schema).
fn json_schema(v: &Value) -> Result<ResponseFormat, ServeError> {
    let Value::Object(o) = v else {
        return Err(wrong_type("response_format.json_schema", "an object", v));
    };
    for (k, x) in o {
        match k.as_str() {
            "name" | "description" => {
                string(&format!("response_format.json_schema.{k}"), x)?;
            }
            "strict" => {
                boolean("response_format.json_schema.strict", x)?;
            }
            "schema" => {}
            _ => {
                return Err(err(
                    codes::UNKNOWN_FIELD,
                    format!(
                        "'response_format.json_schema' has no field '{}' (name, description, \
                         schema, strict)",
                        truncate(k)
                    ),
                ))
            }
        }
    }
    let schema = o.get("schema").ok_or_else(|| {
        err(
            codes::MISSING_FIELD,
            "'response_format.json_schema' needs a 'schema'",
        )
    })?;
    // Compiled on submission, on the scheduler's thread: not here, on the event loop.
    Ok(ResponseFormat::JsonSchema(Arc::new(JsonSchema::new(
        schema.clone(),
    ))))
}

fn messages(v: &Value) -> Result<Vec<ChatMessage>, ServeError> {
    let Value::Array(items) = v else {
        return Err(wrong_type("messages", "an array of {role, content}", v));
    };
    let mut out = Vec::with_capacity(items.len());
    for m in items {
        let Value::Object(o) = m else {
            return Err(wrong_type("messages[]", "an object", m));
        };
        if let Some(k) = o.keys().find(|k| *k != "role" && *k != "content") {
            return Err(err(
                codes::UNKNOWN_FIELD,
                format!("a message has no field '{}' (role, content)", truncate(k)),
            ));
        }
        let role = o
            .get("role")
            .ok_or_else(|| err(codes::MISSING_FIELD, "a message needs a 'role'"))?;
        let content = o
            .get("content")
            .ok_or_else(|| err(codes::MISSING_FIELD, "a message needs 'content'"))?;
        out.push(ChatMessage::new(
            string("role", role)?,
            string("content", content)?,
        ));
    }
    Ok(out)
}

fn speculation(v: &Value) -> Result<SpeculationRequest, ServeError> {
    let Value::Object(o) = v else {
        return Err(wrong_type("speculation", "an object", v));
    };
    let mut s = SpeculationRequest::default();
    for (k, v) in o {
        match k.as_str() {
            "draft" => s.drafters = Some(strings("speculation.draft", v)?),
            "tree" => s.depth = Some(uint("speculation.tree", v, 1024)? as usize),
            "budget" => s.budget = Some(uint("speculation.budget", v, 1 << 16)? as usize),
            "adaptive" => s.adaptive = Some(boolean("speculation.adaptive", v)?),
            "verify" => {
                s.verify = Some(
                    string("speculation.verify", v)?
                        .parse::<VerifyMode>()
                        .map_err(ServeError::from)?,
                )
            }
            other => {
                return Err(err(
                    codes::UNKNOWN_FIELD,
                    format!(
                        "unknown speculation field '{}' ({})",
                        truncate(other),
                        SPEC_FIELDS.join(", ")
                    ),
                ))
            }
        }
    }
    Ok(s)
}

/// The log-probability fields a line carries when the request asked: per generated token
/// (`logprobs`, `top_logprobs`) and, on its first line, the scored prompt's: its token ids,
/// each token's log-probability (`null` for the first, which has no context) and, when
/// alternatives were asked for, each row's.
fn add_probabilities(
    v: &mut Value,
    logprobs: &[f32],
    top_logprobs: &[Vec<(u32, f32)>],
    prompt: Option<&PromptScores>,
) {
    if !logprobs.is_empty() {
        v["logprobs"] = json!(logprobs);
    }
    if !top_logprobs.is_empty() {
        v["top_logprobs"] = alternatives(top_logprobs);
    }
    let Some(p) = prompt else {
        return;
    };
    v["prompt_token_ids"] = json!(p.tokens);
    let mut lps = vec![Value::Null];
    lps.extend(p.logprobs.iter().map(|&l| json!(l)));
    v["prompt_logprobs"] = Value::Array(lps);
    if p.alternatives > 0 {
        let mut tops = vec![Value::Null];
        if let Value::Array(a) = alternatives(&p.top_logprobs) {
            tops.extend(a);
        }
        v["prompt_top_logprobs"] = Value::Array(tops);
    }
}

/// Per token, its alternatives as `[{"token": id, "logprob": x}, ...]`.
fn alternatives(top: &[Vec<(u32, f32)>]) -> Value {
    top.iter()
        .map(|alts| {
            alts.iter()
                .map(|&(t, l)| json!({"token": t, "logprob": l}))
                .collect::<Value>()
        })
        .collect()
}

/// The line for an event of the request the client calls `id` (`None`: a token event of a
/// request that does not stream).
pub fn event_line(id: &Value, ev: &Event, stream: bool) -> Option<String> {
    match ev {
        Event::Error { error, .. } => Some(error_line(Some(id), error)),
        _ => {
            let mut v = event_value(ev, stream)?;
            v["id"] = id.clone();
            if ev.is_final() {
                v["done"] = Value::Bool(true);
            }
            Some(v.to_string())
        }
    }
}

/// A token line of choice `index` of a request with several choices (`n` > 1).
pub fn choice_tokens_line(id: &Value, index: usize, ev: &Event, stream: bool) -> Option<String> {
    let mut v = event_value(ev, stream)?;
    v["id"] = id.clone();
    v["index"] = json!(index);
    Some(v.to_string())
}

/// The end of choice `index` (an entry of the final line's `choices`): what a request's final
/// line says, without `id` and `done`.
pub fn choice_value(index: usize, c: &Completion, stream: bool) -> Value {
    let mut v = completion_value(c, stream);
    v["index"] = json!(index);
    v
}

/// A choice that never started (the request ended first): no tokens, no timing.
pub fn unstarted_choice_value(index: usize, reason: FinishReason, stream: bool) -> Value {
    let mut v = json!({
        "index": index,
        "finish_reason": reason.as_str(),
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0},
        "spec": null,
        "timing": null,
    });
    if !stream {
        v["text"] = json!("");
        v["tokens"] = json!([]);
    }
    v
}

/// The final line of a request with several choices: every choice's end, by index, and the
/// usage of them all (the prompt counted once).
pub fn choices_line(id: &Value, choices: Vec<Value>) -> String {
    let usage = |c: &Value, k: &str| c["usage"][k].as_u64().unwrap_or(0);
    let prompt = choices.iter().map(|c| usage(c, "prompt_tokens")).max();
    let completion: u64 = choices.iter().map(|c| usage(c, "completion_tokens")).sum();
    let cached: u64 = choices
        .iter()
        .map(|c| usage(c, "cached_prompt_tokens"))
        .sum();
    json!({
        "id": id,
        "done": true,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt.unwrap_or(0),
            "completion_tokens": completion,
            "cached_prompt_tokens": cached,
        },
    })
    .to_string()
}

/// A token event's or a completion's fields (`None` for token events when not streaming, and
/// for errors).
fn event_value(ev: &Event, stream: bool) -> Option<Value> {
    match ev {
        Event::Tokens {
            tokens,
            logprobs,
            top_logprobs,
            text,
            prompt,
            ..
        } => {
            if !stream {
                return None;
            }
            let mut v = json!({"text": text, "tokens": tokens});
            add_probabilities(&mut v, logprobs, top_logprobs, prompt.as_deref());
            Some(v)
        }
        Event::Done(c) => Some(completion_value(c, stream)),
        Event::Error { .. } => None,
    }
}

fn completion_value(c: &Completion, stream: bool) -> Value {
    let mut v = json!({
        "finish_reason": c.finish_reason.as_str(),
        "usage": {
            "prompt_tokens": c.usage.prompt_tokens,
            "completion_tokens": c.usage.completion_tokens,
            "cached_prompt_tokens": c.usage.cached_prompt_tokens,
        },
        "spec": c.spec.map(|s| json!({
            "steps": s.steps,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "mean_accepted": s.mean_accepted,
        })),
        "timing": {
            "queue_ms": c.timing.queue_ms,
            "ttft_ms": c.timing.ttft_ms,
            "total_ms": c.timing.total_ms,
        },
    });
    if !stream {
        v["text"] = Value::String(c.text.clone());
        v["tokens"] = json!(c.tokens);
        add_probabilities(&mut v, &c.logprobs, &c.top_logprobs, c.prompt.as_deref());
    }
    v
}

pub fn error_line(id: Option<&Value>, e: &ServeError) -> String {
    json!({
        "id": id.cloned().unwrap_or(Value::Null),
        "error": {"code": e.code, "message": e.message},
    })
    .to_string()
}

/// An error that ends no request although its line named one (`key`: `"rejected_id"` for a
/// request line refused without starting, e.g. a duplicate id; `"cancel"` for a cancel of no
/// request in flight). `"id"` stays null, so a line with an id and `error` is always the final
/// line of that request.
pub fn rejected_line(key: &str, id: &Value, e: &ServeError) -> String {
    let mut v = json!({
        "id": Value::Null,
        "error": {"code": e.code, "message": e.message},
    });
    v[key] = id.clone();
    v.to_string()
}

/// `slow_reader_connections`: connections closed because their client stopped reading (the
/// engine's `slow_readers` counts requests whose consumer stopped reading).
pub fn stats_line(s: &EngineStats, connections: usize, slow_reader_connections: u64) -> String {
    json!({"stats": {
        "running": s.running,
        "waiting": s.waiting,
        "preempted": s.preempted,
        "prefix_waits": s.prefix_waits,
        "kv_blocks_total": s.kv_blocks_total,
        "kv_blocks_used": s.kv_blocks_used,
        "kv_blocks_cached": s.kv_blocks_cached,
        "kv_blocks_free": s.kv_blocks_free,
        "prefix_hit_rate": s.prefix_hit_rate,
        "mean_accepted": s.mean_accepted,
        "tok_s": s.tok_s,
        "drafter_failures": s.drafter_failures,
        "draft_wait_ms": s.draft_wait_ms,
        "drafted_steps": s.drafted_steps,
        "completed": s.completed,
        "cancelled": s.cancelled,
        "failed": s.failed,
        "slow_readers": s.slow_readers,
        "slow_reader_connections": slow_reader_connections,
        "steps": s.steps,
        "step_ms": s.step_ms,
        "step_gap_ms": s.step_gap_ms,
        "kv_messages_per_step": s.kv_messages_per_step,
        "kv_wait_ms": s.kv_wait_ms,
        "connections": connections,
    }})
    .to_string()
}

pub fn health_line(info: &EngineInfo) -> String {
    json!({"health": "ok", "model": info.model, "context_length": info.context_length,
           "drafters": info.drafters})
    .to_string()
}
