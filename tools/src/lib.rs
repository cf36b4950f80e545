//! Arbor tools library: the model registry and PyPI fetcher, and the benchmark drivers behind the `arbor` CLI.

pub mod batch_bench;
pub mod bench;
pub mod fetch;
pub mod load;
pub mod progress;
pub mod serve;
pub mod serve_bench;
pub mod spec_bench;

pub use fetch::{resolve_model, FetchError};
