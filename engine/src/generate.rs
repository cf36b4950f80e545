//! Incremental (token-by-token) generation: prefill in one forward pass, then one pass per token, with streaming.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, BatchMask};
use crate::error::{EngineError, Result};
use crate::kv::{KvCache, KvPool, BLOCK_SLOTS};
use crate::model::Model;
use crate::sample::json::{JsonConstraint, JsonVocab};
use crate::sample::penalty::{validate_logit_bias, Penalties, PenaltyHistory};
use crate::sample::schema::{JsonGrammar, JsonSchema};
use crate::sample::{SamplingParams, MAX_TOP_LOGPROBS};
use crate::sched::{Finish, SchedConfig, Scheduler};
use crate::shared::Shared;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends when the text contains one of these; the stop string is not emitted.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// End-of-generation tokens do not end generation before this many tokens (they are kept
    /// as generated tokens, not masked; stop strings still apply).
    pub min_tokens: usize,
    /// Report each generated token's log-probability under the model
    /// ([`crate::sample::log_softmax_at`] of the row it was drawn from: after the penalties,
    /// before temperature and truncation) with the token.
    pub logprobs: bool,
    /// With `logprobs`: also each token's this many most likely alternatives (token,
    /// log-probability; at most [`crate::sample::MAX_TOP_LOGPROBS`]), as OpenAI's API.
    pub top_logprobs: usize,
    /// Repetition, frequency and presence penalties ([`crate::sample::penalty`]), applied
    /// before the sampling parameters; off by default.
    pub penalties: Penalties,
    /// (token, value) added to the token's logit before the penalties (OpenAI's `logit_bias`;
    /// see [`crate::sample::penalty::validate_logit_bias`]); empty by default.
    pub logit_bias: Vec<(u32, f32)>,
    /// Generation ends at any of these tokens, as at an end-of-generation token (kept in the
    /// output tokens, its text not emitted, not before `min_tokens`), also with `ignore_eos`
    /// (vLLM's `stop_token_ids`); at most [`MAX_STOP_TOKEN_IDS`].
    pub stop_token_ids: Vec<u32>,
    /// `Some(k)`: report each prompt token's log-probability under the model given the tokens
    /// before it (the raw logits: no bias, no penalties), with its `k` most likely alternatives
    /// (at most [`crate::sample::MAX_TOP_LOGPROBS`]); scoring a prompt computes every one of its
    /// rows, so such a request reads no prefix from the cache.
    pub prompt_logprobs: Option<usize>,
    /// What the output must be: any text, or (JSON mode) one JSON object, or one JSON text
    /// matching a schema, every token that cannot continue one masked
    /// ([`crate::sample::json`]).
    pub response_format: ResponseFormat,
}

/// What a request's output must be (OpenAI's `response_format`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ResponseFormat {
    #[default]
    Text,
    /// One JSON object (RFC 8259), then only whitespace and end-of-generation or stop tokens.
    JsonObject,
    /// One JSON text matching a schema ([`JsonSchema`], compiled on submission), then as
    /// `JsonObject`.
    JsonSchema(Arc<JsonSchema>),
}

impl ResponseFormat {
    /// The grammar the output follows (`None` for any text); a schema Arbor cannot compile
    /// is an `invalid_argument` error.
    pub fn grammar(&self) -> Result<Option<Arc<JsonGrammar>>> {
        Ok(match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(JsonGrammar::any_object()),
            ResponseFormat::JsonSchema(s) => Some(s.grammar()?),
        })
    }
}

/// Most `stop_token_ids` of one request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            logprobs: false,
            top_logprobs: 0,
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
            stop_token_ids: Vec::new(),
            prompt_logprobs: None,
            response_format: ResponseFormat::Text,
        }
    }
}

impl GenerateParams {
    /// Reject settings no request could mean, for a model of `vocab` tokens (`usize::MAX`
    /// where the model is not known yet: token ids are then checked on submission).
    pub fn validate(&self, vocab: usize) -> Result<()> {
        self.sampling.validate()?;
        self.penalties.validate()?;
        validate_logit_bias(&self.logit_bias, vocab)?;
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(EngineError::InvalidArgument(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            )));
        }
        if let Some(k) = self.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(EngineError::InvalidArgument(format!(
                "prompt_logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"
            )));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(EngineError::InvalidArgument(format!(
                "stop_token_ids holds {} tokens; at most {MAX_STOP_TOKEN_IDS}",
                self.stop_token_ids.len()
            )));
        }
        if let Some(t) = self.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidArgument(format!(
                "stop_token_ids token {t} is outside the vocabulary (size {vocab})"
            )));
        }
        Ok(())
    }

    /// Whether `tok`, the `n_generated`-th generated token, is one of `stop_token_ids` that
    /// may end generation here (past `min_tokens`).
    pub fn stops_at(&self, tok: u32, n_generated: usize) -> bool {
        n_generated > self.min_tokens && self.stop_token_ids.contains(&tok)
    }

    /// The bias, penalties and JSON mode of a request after `prompt`, or `None` when it has
    /// none of them. JSON mode reads the model's vocabulary from `json` (an
    /// `invalid_argument` error without one).
    pub fn logits_history(
        &self,
        prompt: &[u32],
        json: Option<&Arc<JsonVocab>>,
    ) -> Result<Option<PenaltyHistory>> {
        let json = match self.response_format.grammar()? {
            None => None,
            Some(grammar) => {
                let vocab = json.ok_or_else(|| {
                    EngineError::InvalidArgument(
                        "response_format json_object / json_schema needs the model's tokenizer"
                            .into(),
                    )
                })?;
                Some(JsonConstraint::new(
                    Arc::clone(vocab),
                    grammar,
                    &self.stop_token_ids,
                    self.min_tokens,
                    self.ignore_eos,
                ))
            }
        };
        if self.penalties.is_off() && self.logit_bias.is_empty() && json.is_none() {
            return Ok(None);
        }
        Ok(Some(
            PenaltyHistory::new(self.penalties, prompt)
                .with_bias(&self.logit_bias)
                .with_json(json),
        ))
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// The model emitted an end-of-generation token or one of the request's
    /// `stop_token_ids`.
    Eos,
    /// A stop string appeared.
    Stop,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
        }
    }
}

/// Result and timing of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub text: String,
    /// Generated token ids (EOS included when it ended generation).
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub finish_reason: FinishReason,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Forward passes after the prefill.
    pub decode_steps: usize,
}

impl GenerateOutput {
    pub fn generated_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_secs)
    }

    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_steps, self.decode_secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Holds back text that might be the start of a stop string.
pub(crate) struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

impl StopFilter {
    pub(crate) fn new(stops: &[String]) -> Self {
        StopFilter {
            stops: stops.to_vec(),
            pending: String::new(),
        }
    }

    /// Feed new text; returns (text safe to emit, whether a stop string was hit).
    pub(crate) fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.pending.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    pub(crate) fn finish(self) -> String {
        self.pending
    }
}

/// Turns generated tokens into streamed text: end-of-generation tokens, incremental
/// detokenization and stop strings. Shared by incremental and speculative generation, so both
/// end and stream exactly alike.
pub(crate) struct TokenSink<'a, F: FnMut(&str)> {
    tokenizer: Shared<'a, Tokenizer>,
    ignore_eos: bool,
    min_tokens: usize,
    stop_token_ids: Vec<u32>,
    detok: StreamDecoder<'a>,
    stop: StopFilter,
    on_text: F,
    text: String,
    pub(crate) tokens: Vec<u32>,
}

impl<'a, F: FnMut(&str)> TokenSink<'a, F> {
    pub(crate) fn new(
        tokenizer: impl Into<Shared<'a, Tokenizer>>,
        params: &GenerateParams,
        on_text: F,
    ) -> Self {
        let tokenizer = tokenizer.into();
        TokenSink {
            detok: StreamDecoder::new(tokenizer.clone(), true),
            tokenizer,
            ignore_eos: params.ignore_eos,
            min_tokens: params.min_tokens,
            stop_token_ids: params.stop_token_ids.clone(),
            stop: StopFilter::new(&params.stop),
            on_text,
            text: String::new(),
            tokens: Vec::new(),
        }
    }

    /// The text emitted so far.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    fn emit(&mut self, s: &str) {
        if !s.is_empty() {
            (self.on_text)(s);
            self.text.push_str(s);
        }
    }

    /// Take one generated token; `Some(reason)` when generation must end here.
    pub(crate) fn push(&mut self, tok: u32) -> Option<FinishReason> {
        self.tokens.push(tok);
        if self.tokens.len() > self.min_tokens
            && ((!self.ignore_eos && self.tokenizer.is_eog(tok))
                || self.stop_token_ids.contains(&tok))
        {
            return Some(FinishReason::Eos);
        }
        let (out, hit) = self.stop.push(&self.detok.push(tok));
        self.emit(&out);
        hit.then_some(FinishReason::Stop)
    }

    /// Flush held-back text; returns (text, tokens, final finish reason).
    pub(crate) fn finish(mut self, reason: FinishReason) -> (String, Vec<u32>, FinishReason) {
        let mut reason = reason;
        if reason != FinishReason::Stop {
            let rest = std::mem::replace(
                &mut self.detok,
                StreamDecoder::new(self.tokenizer.clone(), true),
            );
            let (out, hit) = self.stop.push(&rest.finish());
            self.emit(&out);
            if hit {
                reason = FinishReason::Stop;
            } else {
                let held = std::mem::replace(&mut self.stop, StopFilter::new(&[])).finish();
                self.emit(&held);
            }
        }
        (self.text, self.tokens, reason)
    }
}

/// Reject prompts no generation can start from.
pub(crate) fn check_prompt(model: &Model, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidArgument("the prompt is empty".into()));
    }
    let limit = model.config.context_length;
    if prompt.len() >= limit {
        return Err(EngineError::ContextOverflow {
            needed: prompt.len() + 1,
            limit,
        });
    }
    Ok(())
}

/// Run the prompt through the model in one (chunked) pass; returns the last position's logits
/// and the seconds it took.
pub(crate) fn prefill<B: Backend>(
    model: &Model,
    backend: &B,
    cache: &mut KvCache,
    prompt: &[u32],
) -> Result<(Vec<f32>, f64)> {
    let t0 = Instant::now();
    let positions: Vec<usize> = (0..prompt.len()).collect();
    let logits = model.forward(
        backend,
        cache,
        prompt,
        &positions,
        BatchMask::Causal,
        &[prompt.len() - 1],
    )?;
    Ok((logits, t0.elapsed().as_secs_f64()))
}

/// Generate from `prompt` token ids, calling `on_text` with each piece of new text as it becomes
/// final: one request through the continuous-batching [`Scheduler`] (the rules of a served
/// request, exactly), in a private KV pool that holds its whole sequence.
pub fn generate<B: Backend>(
    model: &Model,
    backend: &B,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput> {
    check_prompt(model, prompt)?;
    if params.prompt_logprobs.is_some() {
        return Err(EngineError::InvalidArgument(
            "prompt_logprobs: the scheduler's events carry the scores (`Scheduler`, the \
             server); `generate` returns none"
                .into(),
        ));
    }
    let cap = prompt
        .len()
        .saturating_add(params.max_tokens)
        .min(model.config.context_length);
    let pool = KvPool::elastic(
        &model.config,
        model.config.n_layers,
        cap.div_ceil(BLOCK_SLOTS) + 1,
    );
    // The whole prompt in one step (the forward pass chunks it), as a lone request's prefill.
    let config = SchedConfig {
        max_step_tokens: prompt.len(),
        max_running: 1,
        prefill_chunk: prompt.len(),
        prefix_caching: false,
    };
    let mut sched = Scheduler::new(model, Some(tokenizer), pool, config)?;
    sched.submit(prompt.to_vec(), params.clone())?;
    let t0 = Instant::now();
    let mut t1 = None;
    loop {
        for ev in sched.step(backend)? {
            if !ev.tokens.is_empty() && t1.is_none() {
                t1 = Some(Instant::now());
            }
            if !ev.text.is_empty() {
                on_text(&ev.text);
            }
            match ev.finish {
                Some(Finish::Done {
                    reason,
                    tokens,
                    text,
                    ..
                }) => {
                    let t1 = t1.unwrap_or(t0);
                    return Ok(GenerateOutput {
                        text,
                        tokens,
                        prompt_tokens: prompt.len(),
                        finish_reason: reason,
                        prefill_secs: t1.duration_since(t0).as_secs_f64(),
                        decode_secs: t1.elapsed().as_secs_f64(),
                        // Passes after the prefill's.
                        decode_steps: sched.stats().steps.saturating_sub(1) as usize,
                    });
                }
                Some(Finish::Failed(e)) => return Err(e),
                None => {}
            }
        }
        if sched.is_idle() {
            return Err(EngineError::InvalidArgument(
                "the scheduler dropped the request".into(),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn stop_filter_holds_back_partial_matches() {
        let stops = vec!["</end>".to_string()];
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("hello </"), ("hello ".to_string(), false));
        assert_eq!(f.push("en"), (String::new(), false));
        assert_eq!(f.push("d> tail"), (String::new(), true));
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("a</b"), ("a</b".to_string(), false));
        assert_eq!(f.push("</e"), (String::new(), false));
        assert_eq!(f.finish(), "</e");
    }
}
