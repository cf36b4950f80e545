//! Arbor actors (request intake, drafting, tree merging, KV allocation, verification, TCP server).
//!
//! This crate is intentionally thin until the serving issue lands: it fixes the dependency
//! direction (tools → actors → engine) and re-exports the engine for its users.

pub use arbor_engine as engine;
