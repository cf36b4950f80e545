//! The PromptTokenizer actor: renders a request's chat messages with the model's template and tokenizes its prompt on a thread of its own, and compiles its JSON schema there, so a long prompt (up to the line limit, a MiB) or a schema full of patterns never stalls the Verifier's steps for the requests already running.

use std::sync::Arc;

use actix::{Actor, Handler, SyncContext};
use arbor_engine::{ResponseFormat, Tokenizer};

use crate::error::{codes, Result, ServeError};
use crate::messages::Tokenize;
use crate::request::Input;

pub struct PromptTokenizer {
    tokenizer: Arc<Tokenizer>,
}

impl PromptTokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>) -> PromptTokenizer {
        PromptTokenizer { tokenizer }
    }

    /// The prompt's tokens (BOS as the model wants it); an empty prompt is an error.
    pub fn tokenize(&self, input: &Input) -> Result<Vec<u32>> {
        let text = match input {
            Input::Prompt(p) => std::borrow::Cow::Borrowed(p.as_str()),
            Input::Messages(m) => {
                std::borrow::Cow::Owned(self.tokenizer.apply_chat_template(m, true))
            }
        };
        let prompt = self.tokenizer.encode_prompt(&text)?;
        if prompt.is_empty() {
            return Err(ServeError::new(
                codes::EMPTY_PROMPT,
                "the prompt has no tokens",
            ));
        }
        Ok(prompt)
    }
}

impl Actor for PromptTokenizer {
    type Context = SyncContext<Self>;
}

impl Handler<Tokenize> for PromptTokenizer {
    type Result = Result<Vec<u32>>;

    fn handle(&mut self, msg: Tokenize, _: &mut SyncContext<Self>) -> Result<Vec<u32>> {
        let work = || {
            let prompt = self.tokenize(&msg.input)?;
            if msg.format != ResponseFormat::Text {
                // Compiled once for the request (its choices share it) and the vocabulary's
                // pieces built once for the model: neither on the Verifier's thread.
                msg.format.grammar().map_err(ServeError::from)?;
                self.tokenizer.json_vocab();
            }
            Ok(prompt)
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
            Ok(r) => r,
            Err(p) => Err(ServeError::internal(format!(
                "tokenizing panicked: {}",
                arbor_engine::spec::panic_message(&*p)
            ))),
        }
    }
}
