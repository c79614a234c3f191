//! Two helpers every part of burn-comm shares, with no dependency of their own, so that the
//! transports, the store and the communicator need not import each other for them.

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, going on after a panic elsewhere: every mutex of burn-comm guards data that
/// each writer leaves consistent (counters, queues, a stream whose calls catch their panics).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// The text of a panic's payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}
