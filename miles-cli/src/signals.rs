//! SIGINT and SIGTERM. In a process that runs the work ([`StopSignal`]) the first asks it to
//! stop after the phase in progress (one rank of several: after the step in progress, as its
//! peers), and the second ends the process at once; in the launcher
//! of `--nproc-per-node` ([`Forwarder`]) every one is passed on to the ranks. Either way a run
//! that a signal stopped exits with 128 + the signal (130 for SIGINT, 143 for SIGTERM).

use std::fmt;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use anyhow::Context;
pub use signal_hook::consts::SIGINT;
use signal_hook::consts::SIGTERM;
use signal_hook::flag;
use signal_hook::iterator::Signals;

/// The signals that stop a run.
const STOP_SIGNALS: [i32; 2] = [SIGINT, SIGTERM];

/// The name of a stop signal, for messages.
fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// The exit status of a run that `signal` stopped: 128 + the signal.
fn status_of(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}

/// Watches SIGINT and SIGTERM for a process that runs the work itself.
///
/// The first one sets the [`flag`](Self::flag) (the work stops after its phase or step, saves and
/// writes what it has); a second one ends the process at once with 128 + its number, which
/// leaves no partial file behind because every checkpoint and metrics write lands by rename
/// or whole lines. A clone watches the same signals.
#[derive(Clone)]
pub struct StopSignal {
    requested: Arc<AtomicBool>,
    received: Arc<AtomicUsize>,
}

impl StopSignal {
    /// Installs the handlers.
    ///
    /// # Errors
    /// When the operating system refuses a handler.
    pub fn install() -> anyhow::Result<StopSignal> {
        let requested = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicUsize::new(0));
        for signal in STOP_SIGNALS {
            let code = i32::from(status_of(signal));
            // Registered first, so it sees the flag as the previous signal left it.
            flag::register_conditional_shutdown(signal, code, Arc::clone(&requested))
                .and_then(|_| flag::register_usize(signal, Arc::clone(&received), signal as usize))
                .and_then(|_| flag::register(signal, Arc::clone(&requested)))
                .with_context(|| format!("cannot install the {} handler", name(signal)))?;
        }
        Ok(StopSignal {
            requested,
            received,
        })
    }

    /// The flag the first signal sets: hand it to the work as its stop flag.
    pub fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.requested)
    }

    /// The signal that asked the work to stop, if one did.
    pub fn received(&self) -> Option<Interrupted> {
        match self.received.load(Ordering::SeqCst) {
            0 => None,
            signal => Some(Interrupted {
                signal: i32::try_from(signal).unwrap_or(SIGINT),
            }),
        }
    }
}

/// Passes SIGINT and SIGTERM on to the ranks the launcher started, each as it arrives.
pub struct Forwarder {
    signals: Signals,
    first: Option<i32>,
}

impl Forwarder {
    /// Starts catching the stop signals.
    ///
    /// # Errors
    /// When the operating system refuses a handler.
    pub fn install() -> anyhow::Result<Forwarder> {
        let signals = Signals::new(STOP_SIGNALS).context("cannot catch SIGINT and SIGTERM")?;
        Ok(Forwarder {
            signals,
            first: None,
        })
    }

    /// The signals that arrived since the last call, in order.
    pub fn arrived(&mut self) -> Vec<i32> {
        let arrived: Vec<i32> = self.signals.pending().collect();
        if let Some(&signal) = arrived.first() {
            self.first.get_or_insert(signal);
        }
        arrived
    }

    /// The first signal that arrived, if one did.
    pub fn received(&self) -> Option<Interrupted> {
        self.first.map(|signal| Interrupted { signal })
    }
}

/// A run that a signal stopped after saving and writing what it had; `main` exits with 128 +
/// the signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interrupted {
    /// The signal's number.
    pub signal: i32,
}

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stopped by {} (exit status {})",
            name(self.signal),
            status_of(self.signal)
        )
    }
}

impl std::error::Error for Interrupted {}

/// The exit status of `error` when a signal stopped the run.
pub fn exit_status(error: &anyhow::Error) -> Option<ExitCode> {
    error
        .downcast_ref::<Interrupted>()
        .map(|stopped| ExitCode::from(status_of(stopped.signal)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigint_exits_130_and_sigterm_143() {
        assert_eq!(status_of(SIGINT), 130);
        assert_eq!(status_of(SIGTERM), 143);
        let error = anyhow::Error::new(Interrupted { signal: SIGTERM });
        assert!(exit_status(&error).is_some());
        assert!(error.to_string().contains("SIGTERM"), "{error}");
        assert!(exit_status(&anyhow::anyhow!("failed")).is_none());
    }
}
