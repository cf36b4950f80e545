//! Hand-written PTX kernels, embedded at build time, and their cust launch wrappers (feature `cuda`).

include!(concat!(env!("OUT_DIR"), "/ptx.rs"));

#[cfg(feature = "cuda")]
pub mod launch;
pub mod plan;

/// Errors of the GPU kernel crate.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("not compiled with CUDA (rebuild with --features cuda)")]
    NotCompiledWithCuda,
    #[error("unknown kernel module '{0}'")]
    UnknownModule(String),
    #[error("CUDA error: {0}")]
    Cuda(String),
    #[error("invalid launch plan: {0}")]
    InvalidPlan(String),
}

impl KernelError {
    pub fn error_type(&self) -> &'static str {
        match self {
            KernelError::NotCompiledWithCuda => "not_compiled_with_cuda",
            KernelError::UnknownModule(_) => "unknown_kernel_module",
            KernelError::Cuda(_) => "cuda_error",
            KernelError::InvalidPlan(_) => "invalid_launch_plan",
        }
    }
}

/// The PTX source of a module by name.
pub fn module_source(name: &str) -> Result<&'static str, KernelError> {
    MODULES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, src)| *src)
        .ok_or_else(|| KernelError::UnknownModule(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_declares_its_entry_point() {
        assert!(MODULES.len() >= 2);
        for (name, src) in MODULES {
            assert!(src.contains(".version"), "{name} lacks a PTX version");
            let header: String = src
                .lines()
                .take_while(|l| l.starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            for part in ["Launch:", "Args:", "Shared memory:", "Reference:"] {
                assert!(
                    header.contains(part),
                    "{name}.ptx's opening comment lacks {part}"
                );
            }
            assert!(
                src.contains(&format!(".visible .entry {name}(")),
                "{name}.ptx must define an entry named after the file"
            );
        }
        assert!(module_source("rms_norm_f32").is_ok());
        assert_eq!(
            module_source("nope").unwrap_err().error_type(),
            "unknown_kernel_module"
        );
    }

    /// With ARBOR_REQUIRE_PTXAS=1 (CI), the build must have assembled every kernel.
    #[test]
    fn kernels_were_assembled_when_required() {
        if std::env::var("ARBOR_REQUIRE_PTXAS").as_deref() != Ok("1") {
            return;
        }
        let ptxas = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into());
        for (name, src) in MODULES {
            let dir = std::env::temp_dir().join(format!("arbor-ptx-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let p = dir.join(format!("{name}.ptx"));
            std::fs::write(&p, src).unwrap();
            for arch in ["sm_80", "sm_90"] {
                let out = std::process::Command::new(&ptxas)
                    .arg(format!("-arch={arch}"))
                    .arg("-o")
                    .arg(dir.join(format!("{name}.{arch}.cubin")))
                    .arg(&p)
                    .output()
                    .expect("ptxas runs");
                assert!(
                    out.status.success(),
                    "{name} ({arch}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}
