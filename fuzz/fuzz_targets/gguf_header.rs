//! Fuzz the GGUF parser and model loader: any byte string must give Ok or Err, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = arbor_engine::GgufFile::from_bytes(data.to_vec()) {
        for t in g.tensors() {
            let _ = g.tensor_bytes(t);
        }
        let _ = arbor_engine::Model::from_gguf(g);
    }
});
