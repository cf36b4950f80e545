//! What callers submit (`Request`) and what passes the edge checks (`ValidRequest`), TGI-router style: everything a client controls is checked here, once.

use std::time::Duration;

use arbor_engine::sample::verify::VerifyMode;
use arbor_engine::{ChatMessage, GenerateParams, Penalties, ResponseFormat, SamplingParams};

use crate::config::Limits;
use crate::error::{codes, Result, ServeError};

/// The prompt: plain text (tokenized as `arbor generate --prompt` does) or chat messages
/// (rendered through the model's chat template with the generation prompt appended).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    Prompt(String),
    Messages(Vec<ChatMessage>),
}

/// Per-request speculation settings: caps within what the engine was started with (never new
/// drafters or models).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculationRequest {
    /// Drafters to use, by name (a subset of the engine's); `Some(vec![])` = no speculation;
    /// `None` = all of the engine's drafters.
    pub drafters: Option<Vec<String>>,
    /// Most draft depth per step (at most the engine's).
    pub depth: Option<usize>,
    /// Most draft nodes per step (at most the engine's budget).
    pub budget: Option<usize>,
    /// Adaptive tree sizes (the default); `false`: the whole drafted tree every step, so a
    /// sampled output depends on its seed and settings only, bit for bit, also with speculation.
    pub adaptive: Option<bool>,
    /// Verification rule (default: greedy for temperature 0, MSS otherwise).
    pub verify: Option<VerifyMode>,
}

/// A generation request as a caller builds it.
#[derive(Clone, Debug)]
pub struct Request {
    pub input: Input,
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
    /// Repetition, frequency and presence penalties (off by default).
    pub penalties: Penalties,
    /// (token, value) added to the token's logit before the penalties (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub stop: Vec<String>,
    /// Generation ends at any of these tokens (as at an end-of-generation token, also with
    /// `ignore_eos`; not before `min_tokens`).
    pub stop_token_ids: Vec<u32>,
    /// Report each generated token's log-probability under the model (after the penalties,
    /// before temperature and truncation) with the token.
    pub logprobs: bool,
    /// With `logprobs`: each token's this many most likely alternatives too (0 to 20).
    pub top_logprobs: usize,
    /// `Some(k)`: the prompt's tokens scored by the model (each one's log-probability given
    /// those before it, raw logits), with `k` (0 to 20) alternatives each; on the first event.
    pub prompt_logprobs: Option<usize>,
    /// What the output must be: any text, one JSON object (JSON mode), or one JSON text
    /// matching a schema (compiled after submission: a schema Arbor cannot compile is the
    /// stream's `invalid_argument` error).
    pub response_format: ResponseFormat,
    /// End the request (finish reason `deadline`) this long after submission.
    pub deadline: Option<Duration>,
    /// `None`: the engine's default (speculate with every drafter it has).
    pub speculation: Option<SpeculationRequest>,
}

impl Request {
    /// A request for `prompt` with default settings (greedy, 128 tokens).
    pub fn prompt(prompt: impl Into<String>) -> Request {
        Request::new(Input::Prompt(prompt.into()))
    }

    pub fn new(input: Input) -> Request {
        Request {
            input,
            max_tokens: 128,
            min_tokens: 0,
            ignore_eos: false,
            sampling: SamplingParams::default(),
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
            prompt_logprobs: None,
            response_format: ResponseFormat::Text,
            deadline: None,
            speculation: None,
        }
    }
}

/// Chat roles the templates know.
pub const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// A request that passed every check that does not need the tokenizer.
#[derive(Clone, Debug)]
pub struct ValidRequest {
    pub input: Input,
    pub params: GenerateParams,
    pub deadline: Option<Duration>,
    /// Resolved speculation: drafter indices into the engine's list, budget, depth, policy.
    pub speculation: Option<ValidSpeculation>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ValidSpeculation {
    pub drafters: Vec<usize>,
    pub budget: usize,
    pub depth: usize,
    pub adaptive: bool,
    pub verify: Option<VerifyMode>,
}

/// The engine-wide speculation settings requests are capped by.
#[derive(Clone, Debug)]
pub struct SpecLimits {
    pub drafter_names: Vec<String>,
    pub budget: usize,
    pub depth: usize,
}

impl ValidRequest {
    /// Check `req` against the engine's limits and drafters.
    pub fn new(req: Request, limits: &Limits, spec: &SpecLimits) -> Result<ValidRequest> {
        match &req.input {
            Input::Prompt(p) if p.is_empty() => {
                return Err(ServeError::new(codes::EMPTY_PROMPT, "prompt is empty"))
            }
            Input::Messages(m) if m.is_empty() => {
                return Err(ServeError::new(codes::EMPTY_PROMPT, "messages is empty"))
            }
            Input::Messages(m) => {
                if let Some(bad) = m.iter().find(|m| !ROLES.contains(&m.role.as_str())) {
                    return Err(ServeError::new(
                        codes::INVALID_ROLE,
                        format!(
                            "role '{}' is not one of system, user, assistant",
                            truncate(&bad.role)
                        ),
                    ));
                }
                if m.iter().all(|m| m.content.is_empty()) {
                    return Err(ServeError::new(
                        codes::EMPTY_PROMPT,
                        "every message is empty",
                    ));
                }
            }
            Input::Prompt(_) => {}
        }
        if req.max_tokens == 0 || req.max_tokens > limits.max_tokens {
            return Err(ServeError::invalid(format!(
                "max_tokens must be between 1 and {}",
                limits.max_tokens
            )));
        }
        if req.min_tokens > req.max_tokens {
            return Err(ServeError::invalid("min_tokens must not exceed max_tokens"));
        }
        if req.top_logprobs > 0 && !req.logprobs {
            return Err(ServeError::invalid("top_logprobs needs logprobs: true"));
        }
        if req.stop.len() > limits.max_stop {
            return Err(ServeError::invalid(format!(
                "at most {} stop strings",
                limits.max_stop
            )));
        }
        if req.stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(ServeError::invalid(
                "stop strings must be 1 to 256 bytes long",
            ));
        }
        let deadline = match req.deadline {
            Some(d) if d.is_zero() => {
                return Err(ServeError::invalid("deadline_ms must be positive"))
            }
            Some(d) => Some(d.min(limits.max_deadline)),
            None => Some(limits.max_deadline),
        };
        let speculation = resolve_speculation(req.speculation, &req.sampling, spec)?;
        let params = GenerateParams {
            max_tokens: req.max_tokens,
            sampling: req.sampling,
            stop: req.stop,
            ignore_eos: req.ignore_eos,
            min_tokens: req.min_tokens,
            logprobs: req.logprobs,
            top_logprobs: req.top_logprobs,
            penalties: req.penalties,
            logit_bias: req.logit_bias,
            stop_token_ids: req.stop_token_ids,
            prompt_logprobs: req.prompt_logprobs,
            response_format: req.response_format,
        };
        // Sampling, penalties, bias values and counts; the bias's token ids on submission.
        params.validate(usize::MAX).map_err(ServeError::from)?;
        Ok(ValidRequest {
            input: req.input,
            params,
            deadline,
            speculation,
        })
    }
}

fn resolve_speculation(
    s: Option<SpeculationRequest>,
    sampling: &SamplingParams,
    spec: &SpecLimits,
) -> Result<Option<ValidSpeculation>> {
    let s = s.unwrap_or_default();
    let drafters: Vec<usize> = match &s.drafters {
        None => (0..spec.drafter_names.len()).collect(),
        Some(names) => {
            let mut out = Vec::new();
            for n in names {
                if n == "none" {
                    continue;
                }
                let i = spec
                    .drafter_names
                    .iter()
                    .position(|d| d == n)
                    .ok_or_else(|| {
                        ServeError::invalid(format!(
                            "drafter '{}' is not one the server runs ({})",
                            truncate(n),
                            if spec.drafter_names.is_empty() {
                                "none".to_string()
                            } else {
                                spec.drafter_names.join(", ")
                            }
                        ))
                    })?;
                if !out.contains(&i) {
                    out.push(i);
                }
            }
            out
        }
    };
    let budget = capped("speculation budget", s.budget, spec.budget)?;
    let depth = capped("speculation tree depth", s.depth, spec.depth)?;
    if let Some(VerifyMode::Greedy) = s.verify {
        if !sampling.is_greedy() {
            return Err(ServeError::invalid(
                "greedy verification needs temperature 0 (use mss or naive)",
            ));
        }
    }
    if drafters.is_empty() || budget == 0 || depth == 0 {
        return Ok(None);
    }
    Ok(Some(ValidSpeculation {
        drafters,
        budget,
        depth,
        adaptive: s.adaptive.unwrap_or(true),
        verify: s.verify,
    }))
}

/// A requested value, at most the engine's (its default).
fn capped(what: &str, asked: Option<usize>, max: usize) -> Result<usize> {
    match asked {
        Some(v) if v > max => Err(ServeError::invalid(format!("{what} must be at most {max}"))),
        Some(v) => Ok(v),
        None => Ok(max),
    }
}

/// At most 64 characters of client text in an error message.
pub(crate) fn truncate(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Speculation is adaptive unless a request asks for fixed trees, sampled or not (fixed
    /// trees verify every drafted node: under sampling they are what reproduces a seed's tokens,
    /// at a cost no default should impose).
    #[test]
    fn speculation_is_adaptive_unless_asked_fixed() {
        let spec = SpecLimits {
            drafter_names: vec!["ngram".into()],
            budget: 64,
            depth: 8,
        };
        for temperature in [0.0, 0.7] {
            for asked in [None, Some(true), Some(false)] {
                let mut req = Request::prompt("hi");
                req.sampling.temperature = temperature;
                req.speculation = Some(SpeculationRequest {
                    adaptive: asked,
                    ..SpeculationRequest::default()
                });
                let v = ValidRequest::new(req, &Limits::default(), &spec).unwrap();
                let got = v.speculation.expect("speculates").adaptive;
                assert_eq!(
                    got,
                    asked.unwrap_or(true),
                    "t={temperature} asked {asked:?}"
                );
            }
        }
    }
}
