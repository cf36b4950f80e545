//! The actors crate's error: a stable snake_case code (the protocol's `error.code`) and a message; codes extend the engine's (`EngineError::error_type`).

use arbor_engine::EngineError;

/// Stable error codes of the serving layer, one per error case (the table in
/// `docs/protocol.md`). Engine errors keep the engine's codes (`context_overflow`,
/// `invalid_argument`, `kv_pool_exhausted`, ...).
pub mod codes {
    pub const INVALID_UTF8: &str = "invalid_utf8";
    pub const INVALID_JSON: &str = "invalid_json";
    pub const NOT_AN_OBJECT: &str = "not_an_object";
    pub const UNKNOWN_FIELD: &str = "unknown_field";
    pub const MISSING_FIELD: &str = "missing_field";
    pub const INVALID_TYPE: &str = "invalid_type";
    pub const INVALID_ARGUMENT: &str = "invalid_argument";
    pub const EMPTY_PROMPT: &str = "empty_prompt";
    pub const INVALID_ROLE: &str = "invalid_role";
    pub const DUPLICATE_ID: &str = "duplicate_id";
    pub const LINE_TOO_LONG: &str = "line_too_long";
    pub const PROMPT_TOO_LONG: &str = "prompt_too_long";
    pub const CONTEXT_OVERFLOW: &str = "context_overflow";
    pub const KV_POOL_EXHAUSTED: &str = "kv_pool_exhausted";
    pub const TOO_MANY_REQUESTS: &str = "too_many_requests";
    pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";
    pub const IDLE_TIMEOUT: &str = "idle_timeout";
    pub const OVERLOADED: &str = "overloaded";
    pub const UNAUTHORIZED: &str = "unauthorized";
    pub const UNKNOWN_ID: &str = "unknown_id";
    pub const SHUTTING_DOWN: &str = "shutting_down";
    pub const INTERNAL: &str = "internal";

    /// Every code a client can receive from the serving layer, with when it happens.
    pub const ALL: &[(&str, &str)] = &[
        (INVALID_UTF8, "the line is not valid UTF-8"),
        (INVALID_JSON, "the line is not valid JSON"),
        (NOT_AN_OBJECT, "the line is JSON but not an object"),
        (
            UNKNOWN_FIELD,
            "an object has a field the protocol does not define",
        ),
        (
            MISSING_FIELD,
            "a required field is absent (`id`, or both `prompt` and `messages`)",
        ),
        (INVALID_TYPE, "a field has the wrong JSON type"),
        (
            INVALID_ARGUMENT,
            "a value is out of range or not allowed by the server's configuration",
        ),
        (
            EMPTY_PROMPT,
            "`prompt` is empty or `messages` is an empty list",
        ),
        (
            INVALID_ROLE,
            "a chat message's role is not system, user or assistant",
        ),
        (
            DUPLICATE_ID,
            "a request reuses the id of a request still running on this connection",
        ),
        (
            LINE_TOO_LONG,
            "a line is longer than the server's limit (it is discarded up to its newline)",
        ),
        (
            PROMPT_TOO_LONG,
            "the prompt has more tokens than the server's limit",
        ),
        (
            CONTEXT_OVERFLOW,
            "the prompt does not leave room for one token in the model's context",
        ),
        (
            KV_POOL_EXHAUSTED,
            "the request needs more KV blocks than the whole pool holds",
        ),
        (
            TOO_MANY_REQUESTS,
            "the connection already has its maximum of requests in flight",
        ),
        (
            TOO_MANY_CONNECTIONS,
            "the server already has its maximum of connections (answered once, then closed)",
        ),
        (
            IDLE_TIMEOUT,
            "the connection had no request in flight and sent nothing for the server's idle timeout (then closed)",
        ),
        (OVERLOADED, "the server's queue of waiting requests is full"),
        (
            UNAUTHORIZED,
            "the server needs `{\"auth\": TOKEN}` first, or the token is wrong",
        ),
        (
            UNKNOWN_ID,
            "`cancel` names no request in flight on this connection",
        ),
        (
            SHUTTING_DOWN,
            "the server is shutting down and takes no new requests",
        ),
        (
            INTERNAL,
            "a bug in the server (the request is ended; the server keeps running)",
        ),
    ];
}

/// An error of the serving layer; `code` never changes once published.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ServeError {
    pub code: &'static str,
    pub message: String,
}

impl ServeError {
    pub fn new(code: &'static str, message: impl Into<String>) -> ServeError {
        ServeError {
            code,
            message: message.into(),
        }
    }

    /// The stable code (`error.code` on the wire).
    pub fn error_type(&self) -> &'static str {
        self.code
    }

    pub fn invalid(message: impl Into<String>) -> ServeError {
        ServeError::new(codes::INVALID_ARGUMENT, message)
    }

    pub fn internal(message: impl Into<String>) -> ServeError {
        ServeError::new(codes::INTERNAL, message)
    }
}

impl From<EngineError> for ServeError {
    fn from(e: EngineError) -> ServeError {
        ServeError::new(e.error_type(), e.to_string())
    }
}

pub type Result<T, E = ServeError> = std::result::Result<T, E>;
