//! Arbor: tree-based speculative decoding (SpecInfer) on a quantized CPU engine; re-exports the workspace crates.
pub use arbor_actors as actors;
pub use arbor_engine as engine;
