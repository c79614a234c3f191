//! Saving while training goes on, as PyTorch's `async_save` does: the step that checkpoints
//! only hands in its pieces, copied to host memory or to be read as they are written; a thread
//! of each rank then agrees, writes and commits them through a group of its own, so its
//! collectives never interleave with the training's. One save is under way at a time: the next
//! waits for it.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn_comm::Communicator;

use crate::error::CheckpointError;
use crate::save::save;
use crate::shard::Shard;

/// A checkpoint committed in the background.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
    /// From handing the pieces in to the commit.
    pub took: Duration,
    /// Why older checkpoints could not be removed after it (see
    /// [`BackgroundSaver::keeping`]); the checkpoint itself is committed all the same.
    pub prune_failed: Option<String>,
}

struct Pending {
    step: u64,
    thread: JoinHandle<Result<Saved, CheckpointError>>,
}

/// Saves checkpoints in the background, one at a time; a save under way is finished before
/// the saver goes.
pub struct BackgroundSaver {
    /// The savers' own group, split from the run's (none: this process alone).
    comm: Option<Communicator>,
    /// How many committed checkpoints to keep (none: all).
    keep: Option<usize>,
    pending: Option<Pending>,
    /// The outcome of a save found finished by [`BackgroundSaver::has_failed`], not yet
    /// reported.
    finished: Option<Result<Saved, CheckpointError>>,
}

impl BackgroundSaver {
    /// A saver for the ranks of `comm` (this process alone without one). A collective: every
    /// rank of `comm` makes its saver at the same point of its calls, as for a split. A save's
    /// agreement goes through host memory, so on a group on NCCL it goes through the host
    /// group it was made from ([`Communicator::host`]): collectives on another NCCL group from
    /// a second thread could deadlock against the training's. A group on NCCL without one is
    /// refused.
    pub fn new(comm: Option<&Communicator>) -> Result<Self, CheckpointError> {
        let host = match comm {
            Some(comm) => Some(comm.host().ok_or_else(|| {
                CheckpointError::Mismatch(
                    "a checkpoint is saved in the background over a host group, and this group \
                     on NCCL was not made from one (Communicator::nccl_world's, or split from \
                     one): make the saver from a group of the local, MPI or TCP transport"
                        .into(),
                )
            })?),
            None => None,
        };
        let comm = host.map(|c| c.split("checkpoint", 0)).transpose()?;
        Ok(Self {
            comm,
            keep: None,
            pending: None,
            finished: None,
        })
    }

    /// Keeps only the `keep` newest committed checkpoints (at least one): after each save,
    /// rank 0 removes the older ones with [`prune`](crate::prune). A failure to remove them
    /// does not fail the save, which is committed: rank 0's [`Saved`] says why.
    pub fn keeping(mut self, keep: Option<usize>) -> Self {
        self.keep = keep;
        self
    }

    /// Starts saving `shards` as step `step`'s checkpoint under `root`, as [`save`] does, once
    /// the save before it has finished; returns what that one saved. Should that one have
    /// failed, its error is returned and this save is not started. Every rank starts the same
    /// saves in the same order.
    pub fn start(
        &mut self,
        root: &Path,
        step: u64,
        shards: Result<Vec<Shard>, String>,
        metadata: serde_json::Value,
    ) -> Result<Option<Saved>, CheckpointError> {
        let previous = self.wait()?;
        let comm = self.comm.clone();
        let keep = self.keep;
        let root = root.to_path_buf();
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || {
                let dir = save(&root, step, comm.as_ref(), shards, metadata)?;
                let took = started.elapsed();
                let prune_failed = match keep {
                    Some(keep) if comm.as_ref().is_none_or(|c| c.rank() == 0) => {
                        crate::save::prune(&root, keep).err().map(|e| e.to_string())
                    }
                    _ => None,
                };
                Ok(Saved {
                    step,
                    dir,
                    took,
                    prune_failed,
                })
            })
            .map_err(|e| {
                failed(
                    step,
                    CheckpointError::Mismatch(format!("no thread to write it: {e}")),
                )
            })?;
        self.pending = Some(Pending { step, thread });
        Ok(previous)
    }

    /// Waits for the save under way, if any, and returns what it saved.
    pub fn wait(&mut self) -> Result<Option<Saved>, CheckpointError> {
        if let Some(outcome) = self.finished.take() {
            return outcome.map(Some);
        }
        self.pending.take().map(Self::join).transpose()
    }

    /// Whether the save under way has ended, and failed; never waits. The failure is kept
    /// for [`BackgroundSaver::wait`] (or the next start) to return.
    pub fn has_failed(&mut self) -> bool {
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.thread.is_finished())
        {
            self.finished = self.pending.take().map(Self::join);
        }
        matches!(self.finished, Some(Err(_)))
    }

    /// The step whose save is under way, or has ended without being reported.
    pub fn saving(&self) -> Option<u64> {
        match (&self.pending, &self.finished) {
            (Some(pending), _) => Some(pending.step),
            (None, Some(Ok(saved))) => Some(saved.step),
            (None, Some(Err(CheckpointError::Background { step, .. }))) => Some(*step),
            _ => None,
        }
    }

    fn join(pending: Pending) -> Result<Saved, CheckpointError> {
        let outcome = pending.thread.join().unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(CheckpointError::Mismatch(format!(
                "the thread writing it panicked: {why}"
            )))
        });
        outcome.map_err(|e| failed(pending.step, e))
    }
}

/// `error`, saying it befell step `step`'s checkpoint.
fn failed(step: u64, error: CheckpointError) -> CheckpointError {
    CheckpointError::Background {
        step,
        source: Box::new(error),
    }
}

impl Drop for BackgroundSaver {
    fn drop(&mut self) {
        // Its outcome has no one to go to; the save is still finished, not cut short.
        let _ = self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Checkpoint;
    use burn::tensor::TensorData;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "burn-checkpoint-background-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn pieces(value: f32) -> Result<Vec<Shard>, String> {
        Ok(vec![Shard::whole(
            "w",
            TensorData::new(vec![value; 6], [2, 3]),
        )])
    }

    #[test]
    fn each_save_commits_in_turn_and_reports_the_one_before() {
        let root = scratch("turns");
        let mut saver = BackgroundSaver::new(None).unwrap();
        assert_eq!(saver.start(&root, 1, pieces(1.0), json(1)).unwrap(), None);
        assert_eq!(saver.saving(), Some(1));
        let first = saver
            .start(&root, 2, pieces(2.0), json(2))
            .unwrap()
            .unwrap();
        assert_eq!(
            (first.step, first.dir.clone()),
            (1, root.join("step-00000001"))
        );
        let second = saver.wait().unwrap().unwrap();
        assert_eq!(second.step, 2);
        assert!(saver.saving().is_none() && saver.wait().unwrap().is_none());
        let latest = Checkpoint::latest(&root).unwrap().unwrap();
        assert_eq!(latest.step(), 2);
        assert_eq!(latest.metadata()["step"], 2);
        let w = latest.read_whole("w").unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![2.0; 6]);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_failed_save_is_reported_naming_its_step_and_a_dropped_saver_finishes_its_save() {
        let root = scratch("failed");
        let mut saver = BackgroundSaver::new(None).unwrap();
        saver
            .start(&root, 1, Err("no pieces".into()), json(1))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !saver.has_failed() {
            assert!(Instant::now() < deadline, "the failed save never ended");
            std::thread::yield_now();
        }
        assert_eq!(
            saver.saving(),
            Some(1),
            "the failure is kept until reported"
        );
        let error = saver
            .start(&root, 2, pieces(2.0), json(2))
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("the checkpoint after step 1: ") && error.contains("no pieces"),
            "{error}"
        );
        assert_eq!(
            saver.saving(),
            None,
            "the failed save was reported; none started"
        );
        saver.start(&root, 3, pieces(3.0), json(3)).unwrap();
        drop(saver);
        assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 3);
        std::fs::remove_dir_all(root).unwrap();
    }

    fn json(step: u64) -> serde_json::Value {
        serde_json::json!({ "step": step })
    }
}
