//! Saving while training goes on, as PyTorch's `async_save` does: the step that checkpoints
//! only hands in its pieces, already copied to host memory; a thread of each rank then agrees,
//! writes and commits them through a group of its own, so its collectives never interleave
//! with the training's. One save is under way at a time: the next waits for it.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn_comm::Communicator;

use crate::error::CheckpointError;
use crate::save::{Shard, save};

/// A checkpoint committed in the background.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
    /// From handing the pieces in to the commit.
    pub took: Duration,
}

struct Pending {
    step: u64,
    started: Instant,
    thread: JoinHandle<Result<PathBuf, CheckpointError>>,
}

/// Saves checkpoints in the background, one at a time; a save under way is finished before
/// the saver goes.
pub struct BackgroundSaver {
    /// The savers' own group, split from the run's (none: this process alone).
    comm: Option<Communicator>,
    pending: Option<Pending>,
}

impl BackgroundSaver {
    /// A saver for the ranks of `comm` (this process alone without one). A collective: every
    /// rank of `comm` makes its saver at the same point of its calls, as for a split.
    pub fn new(comm: Option<&Communicator>) -> Result<Self, CheckpointError> {
        let comm = comm.map(|c| c.split("checkpoint", 0)).transpose()?;
        Ok(Self {
            comm,
            pending: None,
        })
    }

    /// Starts saving `shards` as step `step`'s checkpoint under `root`, as [`save`] does, once
    /// the save before it has finished; returns what that one saved. Every rank starts the same
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
        let root = root.to_path_buf();
        let thread = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || {
                yield_to_training();
                save(&root, step, comm.as_ref(), shards, metadata)
            })
            .map_err(|e| {
                CheckpointError::Mismatch(format!(
                    "no thread to save step {step}'s checkpoint: {e}"
                ))
            })?;
        self.pending = Some(Pending {
            step,
            started: Instant::now(),
            thread,
        });
        Ok(previous)
    }

    /// Waits for the save under way, if any, and returns what it saved.
    pub fn wait(&mut self) -> Result<Option<Saved>, CheckpointError> {
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let dir = pending.thread.join().map_err(|_| {
            CheckpointError::Mismatch(format!(
                "the thread saving step {}'s checkpoint panicked",
                pending.step
            ))
        })??;
        Ok(Some(Saved {
            step: pending.step,
            dir,
            took: pending.started.elapsed(),
        }))
    }

    /// The step whose save is under way.
    pub fn saving(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.step)
    }
}

/// Lowers the calling thread's priority to the least, so that writing a checkpoint takes only
/// what training leaves of the cores: on a machine with no core to spare, the writer had
/// otherwise slowed the step beside it by more than copying the state aside costs.
fn yield_to_training() {
    // On Linux the niceness is the thread's own; elsewhere it would be the whole process's.
    #[cfg(target_os = "linux")]
    // SAFETY: a plain system call on the calling thread (`who` 0), with no memory passed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
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
    fn a_failed_save_is_reported_by_the_next_call_and_a_dropped_saver_finishes_its_save() {
        let root = scratch("failed");
        let mut saver = BackgroundSaver::new(None).unwrap();
        saver
            .start(&root, 1, Err("no pieces".into()), json(1))
            .unwrap();
        let error = saver.wait().unwrap_err().to_string();
        assert!(error.contains("no pieces"), "{error}");
        saver.start(&root, 3, pieces(3.0), json(3)).unwrap();
        drop(saver);
        assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 3);
        std::fs::remove_dir_all(root).unwrap();
    }

    fn json(step: u64) -> serde_json::Value {
        serde_json::json!({ "step": step })
    }
}
