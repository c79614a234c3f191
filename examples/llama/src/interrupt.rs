//! SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C) ask a run that checkpoints to stop
//! after its step, write a checkpoint, and say how to resume, rather than die and lose the
//! steps since the last one.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// From now on, SIGTERM and SIGINT ask the run to stop after its step (see [`requested`]).
pub fn install() {
    #[cfg(unix)]
    {
        extern "C" fn note(_: libc::c_int) {
            // Only an atomic store: what a signal handler may do.
            REQUESTED.store(true, Ordering::SeqCst);
        }
        let handler = note as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic.
        unsafe {
            libc::signal(libc::SIGTERM, handler);
            libc::signal(libc::SIGINT, handler);
        }
    }
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
