//! Ctrl-C for the whole `arbor load` process: the first press stops sending and cancels what is in flight (the report and `--out` still come; a sweep ends with that rate), a second one exits at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use tokio::sync::Notify;

/// A count of presses that can be waited on.
#[derive(Default)]
pub struct Presses {
    n: AtomicU32,
    notify: Notify,
}

impl Presses {
    pub fn count(&self) -> u32 {
        self.n.load(Ordering::SeqCst)
    }

    /// Count a press; the count after it.
    pub fn press(&self) -> u32 {
        let n = self.n.fetch_add(1, Ordering::SeqCst) + 1;
        self.notify.notify_waiters();
        n
    }

    /// Resolves once there have been more than `seen` presses.
    pub async fn after(&self, seen: u32) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.count() > seen {
                return;
            }
            notified.await;
        }
    }
}

/// The process's Ctrl-C presses (counted by [`watch`]).
fn global() -> &'static Presses {
    static P: OnceLock<Presses> = OnceLock::new();
    P.get_or_init(Presses::default)
}

/// Ctrl-C presses so far.
pub fn presses() -> u32 {
    global().count()
}

/// Resolves once there have been more than `seen` Ctrl-C presses (never without [`watch`]).
pub async fn after(seen: u32) {
    global().after(seen).await
}

/// Watch SIGINT on the current runtime for as long as it runs: the first press ends the run
/// (in-flight requests cancelled, results still written); the second exits with status 130.
pub fn watch() {
    tokio::spawn(async {
        loop {
            if tokio::signal::ctrl_c().await.is_err() {
                return;
            }
            if global().press() >= 2 {
                eprintln!("interrupted twice: exiting without results");
                std::process::exit(130);
            }
            eprintln!("interrupted: cancelling the requests in flight (Ctrl-C again to exit now)");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_press_wakes_those_waiting_for_one_after_theirs() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let p = std::sync::Arc::new(Presses::default());
        rt.block_on(async {
            let seen = p.count();
            let q = std::sync::Arc::clone(&p);
            let waiter = tokio::spawn(async move { q.after(seen).await });
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished());
            assert_eq!(p.press(), 1);
            tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
                .await
                .expect("woken")
                .unwrap();
            // A press already counted resolves at once.
            tokio::time::timeout(std::time::Duration::from_secs(1), p.after(seen))
                .await
                .expect("at once");
        });
    }
}
