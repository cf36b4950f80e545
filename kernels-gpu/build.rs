//! Embeds every `ptx/*.ptx` kernel as a `pub const` and, when `ptxas` is present, assembles each one
//! so a syntax error fails the build (CI installs ptxas; a GPU is never needed).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let dir = Path::new("ptx");
    println!("cargo:rerun-if-changed=ptx");
    println!("cargo:rerun-if-env-changed=PTXAS");
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("kernels-gpu/ptx exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .collect();
    entries.sort();
    let ptxas = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".to_string());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let mut consts = String::new();
    let mut table = String::from("/// Every embedded kernel module: (name, PTX source).\npub const MODULES: &[(&str, &str)] = &[\n");
    for path in &entries {
        println!("cargo:rerun-if-changed={}", path.display());
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 name");
        let abs = std::fs::canonicalize(path).expect("ptx path");
        let name = stem.to_uppercase();
        consts.push_str(&format!(
            "/// PTX source of `{stem}`.\npub const {name}: &str = include_str!({:?});\n",
            abs.display().to_string()
        ));
        table.push_str(&format!("    ({stem:?}, {name}),\n"));
        // Both targets the verifier is meant for (A100-class sm_80, H100/H200 sm_90).
        for arch in ["sm_80", "sm_90"] {
            match Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-o")
                .arg(out_dir.join(format!("{stem}.{arch}.cubin")))
                .arg(&abs)
                .output()
            {
                Ok(o) if o.status.success() => {}
                Ok(o) => panic!(
                    "ptxas rejected {} for {arch}:\n{}",
                    path.display(),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(_) => {
                    println!(
                        "cargo:warning=ptxas not found; {} embedded unchecked",
                        path.display()
                    );
                    break;
                }
            }
        }
    }
    table.push_str("];\n");
    std::fs::write(out_dir.join("ptx.rs"), consts + &table).expect("write ptx.rs");
}
