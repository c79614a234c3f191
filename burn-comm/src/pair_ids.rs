//! Hands the NCCL id of a point-to-point pair from the rank that makes it (the sender) to the
//! rank that joins it (the receiver), outside any communicator: the two meet only when the
//! receiver first receives, and no other rank takes part. Ranks that are threads of one process
//! meet in memory; ranks that are processes meet in the job's store.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::store::Store;
use crate::sync::lock;

/// An NCCL unique id.
pub(crate) type Id = [u8; 128];

/// Where one world's ranks leave pair ids for each other, each under a key that names the pair.
pub(crate) enum PairIds {
    /// The ranks are threads of this process.
    Threads {
        ids: Mutex<HashMap<String, Id>>,
        posted: Condvar,
    },
    /// The ranks are processes: the job's store, served at `store` (a connection per hand-off,
    /// so a receiver waiting in the store never holds up a sender of the same process).
    Processes { store: String, timeout: Duration },
}

impl PairIds {
    pub fn threads() -> Self {
        Self::Threads {
            ids: Mutex::new(HashMap::new()),
            posted: Condvar::new(),
        }
    }

    /// Through the store served at `addr`; a post waits at most `timeout`.
    pub fn processes(addr: &str, timeout: Duration) -> Self {
        Self::Processes {
            store: addr.to_string(),
            timeout,
        }
    }

    /// Leaves `id` under `key` for the one rank that will [`PairIds::take`] it.
    pub fn post(&self, key: &str, id: Id) -> Result<(), String> {
        match self {
            Self::Threads { ids, posted } => {
                lock(ids).insert(key.to_string(), id);
                posted.notify_all();
                Ok(())
            }
            Self::Processes { store, timeout } => Store::connect(store, *timeout)
                .and_then(|mut store| store.set(key, &id))
                .map_err(|e| format!("could not post the id of {key}: {e}")),
        }
    }

    /// The id under `key`, waiting for it at most `timeout`.
    pub fn take(&self, key: &str, timeout: Duration) -> Result<Id, String> {
        let never_posted =
            || format!("nothing was posted under {key} within {timeout:?}: the sender never sent");
        match self {
            Self::Threads { ids, posted } => {
                let deadline = Instant::now().checked_add(timeout);
                let mut ids = lock(ids);
                loop {
                    if let Some(id) = ids.remove(key) {
                        return Ok(id);
                    }
                    let left = match deadline {
                        Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                        None => Duration::from_secs(3600),
                    };
                    if left.is_zero() {
                        return Err(never_posted());
                    }
                    ids = posted
                        .wait_timeout(ids, left)
                        .unwrap_or_else(|poison| poison.into_inner())
                        .0;
                }
            }
            Self::Processes { store, .. } => {
                let value = Store::connect(store, timeout)
                    .and_then(|mut store| store.get(key))
                    .map_err(|e| format!("could not take the id of {key}: {e}"))?;
                Id::try_from(value.as_slice())
                    .map_err(|_| format!("{key} holds {} bytes, not an NCCL id", value.len()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;

    fn id(byte: u8) -> Id {
        [byte; 128]
    }

    fn hands_over(ids: &PairIds) {
        std::thread::scope(|s| {
            let taken = s.spawn(|| ids.take("a->b", Duration::from_secs(10)));
            std::thread::sleep(Duration::from_millis(20));
            ids.post("a->b", id(7)).unwrap();
            ids.post("b->a", id(9)).unwrap();
            assert_eq!(taken.join().unwrap().unwrap(), id(7));
        });
        assert_eq!(ids.take("b->a", Duration::from_secs(1)).unwrap(), id(9));
    }

    #[test]
    fn threads_hand_an_id_to_a_waiting_receiver() {
        hands_over(&PairIds::threads());
    }

    #[test]
    fn processes_hand_an_id_over_through_the_store() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        hands_over(&PairIds::processes(
            &server.addr().to_string(),
            Duration::from_secs(10),
        ));
    }

    #[test]
    fn an_id_never_posted_times_out() {
        let threads = PairIds::threads();
        let error = threads.take("a->b", Duration::from_millis(50)).unwrap_err();
        assert!(error.contains("the sender never sent"), "{error}");
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let processes = PairIds::processes(&server.addr().to_string(), Duration::from_secs(10));
        let error = processes
            .take("a->b", Duration::from_millis(50))
            .unwrap_err();
        assert!(error.contains("could not take the id of a->b"), "{error}");
    }

    #[test]
    fn a_taken_id_is_gone() {
        let threads = PairIds::threads();
        threads.post("a->b", id(1)).unwrap();
        threads.take("a->b", Duration::from_secs(1)).unwrap();
        assert!(threads.take("a->b", Duration::from_millis(10)).is_err());
    }
}
