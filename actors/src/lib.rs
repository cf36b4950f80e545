//! Arbor actors: request intake, drafters and the tree merger (each on its own `SyncArbiter` thread), KV block allocation (its own arbiter thread), verification (the LLM on a `SyncArbiter` thread), the in-process [`Engine`] API, and the line-delimited JSON TCP server.
//!
//! ```no_run
//! use std::sync::Arc;
//! use arbor_actors::{Engine, EngineConfig, Event, Request};
//!
//! let config = EngineConfig::open(std::path::Path::new("model.gguf"))?;
//! let engine = Engine::start(config)?;
//! let handle = engine.submit(Request::prompt("def fibonacci(n):"))?;
//! while let Some(ev) = handle.recv() {
//!     match ev {
//!         Event::Tokens { text, .. } => print!("{text}"),
//!         Event::Done(c) => println!("\n[{}]", c.finish_reason.as_str()),
//!         Event::Error { error, .. } => eprintln!("{error}"),
//!     }
//! }
//! engine.shutdown(std::time::Duration::from_secs(5));
//! # Ok::<(), arbor_actors::ServeError>(())
//! ```

pub mod api;
pub mod config;
pub mod drafter;
pub mod error;
pub mod events;
pub mod intake;
pub mod kv_allocator;
pub mod merger;
pub mod messages;
pub mod prompt;
pub mod request;
pub mod server;
pub mod verifier;

pub use api::{Engine, EngineInfo, EventStream, RequestHandle};
pub use arbor_engine as engine;
pub use config::{DraftContext, DrafterFactory, EngineConfig, Limits};
pub use error::{codes, ServeError};
pub use events::{
    Completion, EngineStats, Event, FinishReason, RequestId, SpecSummary, Timing, Usage,
};
pub use request::{Input, Request, SpeculationRequest, ValidRequest};
