//! SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) ask a run that checkpoints to stop
//! after its step, write a checkpoint, and say how to resume, rather than die and lose the
//! steps since the last one.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// From now on, the first SIGTERM or SIGINT asks the run to stop after its step (see
/// [`requested`]); a second one ends the process at once.
pub fn install() {
    #[cfg(unix)]
    {
        extern "C" fn note(_: libc::c_int) {
            // Only an atomic store: what a signal handler may do.
            REQUESTED.store(true, Ordering::SeqCst);
        }
        // The first signal asks; the handler then resets, so a second one ends the process
        // as it would have.
        // SAFETY: the handler only stores to an atomic; the struct is filled before use.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = note as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGTERM, &action, std::ptr::null_mut());
            libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
        }
    }
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
