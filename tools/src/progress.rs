//! Progress bars (`indicatif`) for the CLI's long work: drawn on stderr when it is a terminal, hidden otherwise, so piped output and tests see only results.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `len` steps of `what`.
pub fn steps(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {msg} [{elapsed_precise}] {bar:30} {pos}/{len} eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar.set_message(what.to_string());
    bar
}
