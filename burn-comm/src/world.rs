//! Every rank of one launch, as this process sees it: what each rank's function has done, the
//! communication jobs each has in flight, and how long a rank waits for its peers. Thread ranks
//! and NCCL keep it; MPI, whose ranks are processes, needs none.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use crate::sync::lock;

/// What a rank's function has done so far.
#[derive(Debug, Clone)]
pub(crate) enum RankStatus {
    Running,
    Returned,
    Failed(String),
}

/// Something that waits on ranks and must wake when one of them returns or fails.
pub(crate) trait Watcher: Send + Sync {
    fn status_changed(&self);
}

/// Every rank of one launch: their status, the watchers to wake when it changes, and their
/// communication jobs in flight.
pub(crate) struct World {
    timeout: Duration,
    status: Mutex<Vec<RankStatus>>,
    watchers: Mutex<Vec<Weak<dyn Watcher>>>,
    /// Communication jobs queued or running, per rank.
    pending: Mutex<Vec<usize>>,
    drained: Condvar,
    /// Where NCCL's point-to-point pairs hand their ids over.
    #[cfg(feature = "cuda")]
    pair_ids: crate::pair_ids::PairIds,
}

impl World {
    /// The world of `size` ranks that are threads of this process.
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Self::build(
            size,
            timeout,
            #[cfg(feature = "cuda")]
            crate::pair_ids::PairIds::threads(),
        )
    }

    /// This process's view of a world whose ranks are processes, meeting in the job's store.
    #[cfg(feature = "cuda")]
    pub fn of_processes(size: usize, timeout: Duration, store: &str) -> Arc<Self> {
        Self::build(
            size,
            timeout,
            crate::pair_ids::PairIds::processes(store, timeout),
        )
    }

    fn build(
        size: usize,
        timeout: Duration,
        #[cfg(feature = "cuda")] pair_ids: crate::pair_ids::PairIds,
    ) -> Arc<Self> {
        Arc::new(Self {
            timeout,
            status: Mutex::new(vec![RankStatus::Running; size]),
            watchers: Mutex::new(Vec::new()),
            pending: Mutex::new(vec![0; size]),
            drained: Condvar::new(),
            #[cfg(feature = "cuda")]
            pair_ids,
        })
    }

    #[cfg(feature = "cuda")]
    pub fn pair_ids(&self) -> &crate::pair_ids::PairIds {
        &self.pair_ids
    }

    /// How long a rank waits for its peers in one call (the NCCL watchdog's limit too).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn job_started(&self, rank: usize) {
        lock(&self.pending)[rank] += 1;
    }

    pub fn job_finished(&self, rank: usize) {
        lock(&self.pending)[rank] -= 1;
        self.drained.notify_all();
    }

    /// Waits until every communication job of `rank` has ended. Each ends by itself: a call
    /// completes, or fails within the timeout.
    pub fn wait_until_drained(&self, rank: usize) {
        let mut pending = lock(&self.pending);
        while pending[rank] > 0 {
            pending = self
                .drained
                .wait(pending)
                .unwrap_or_else(|poison| poison.into_inner());
        }
    }

    /// Wakes `watcher` whenever a rank's status changes, for as long as it lives.
    pub fn watch(&self, watcher: Weak<dyn Watcher>) {
        lock(&self.watchers).push(watcher);
    }

    /// Records what a rank's function did and wakes every watcher.
    pub fn set_status(&self, rank: usize, status: RankStatus) {
        lock(&self.status)[rank] = status;
        let watchers: Vec<Arc<dyn Watcher>> = {
            let mut watchers = lock(&self.watchers);
            watchers.retain(|w| w.strong_count() > 0);
            watchers.iter().filter_map(Weak::upgrade).collect()
        };
        for watcher in watchers {
            watcher.status_changed();
        }
    }

    pub fn status_of(&self, rank: usize) -> RankStatus {
        lock(&self.status)[rank].clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn a_rank_is_drained_only_when_its_last_job_ends() {
        let world = World::new(2, Duration::from_secs(5));
        world.job_started(0);
        world.job_started(0);
        let drained = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (world, drained) = (world.clone(), drained.clone());
            std::thread::spawn(move || {
                world.wait_until_drained(0);
                drained.store(true, Ordering::SeqCst);
            })
        };
        world.job_finished(0);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!drained.load(Ordering::SeqCst), "one job is still pending");
        world.job_finished(0);
        waiter.join().unwrap();
        assert!(drained.load(Ordering::SeqCst));
    }
}
