//! The one line a burn-train user adds: `.data_parallel(comm, device)` on `SupervisedTraining`.

use std::sync::Arc;

use burn::tensor::Device;
use burn_comm::Communicator;
use burn_train::{LearningComponentsTypes, SupervisedTraining, TrainingStrategy};

use crate::quiet::{QuietLogger, QuietRenderer};
use crate::strategy::DataParallelStrategy;

/// Data parallelism for burn-train's `SupervisedTraining`.
pub trait DataParallelTraining<LC: LearningComponentsTypes>: Sized {
    /// Trains data-parallel over `comm` on `device`, with the default settings of
    /// [`DataParallelStrategy`].
    fn data_parallel(self, comm: Communicator, device: Device<LC::Backend>) -> Self {
        self.with_data_parallel_strategy(DataParallelStrategy::new(comm, device))
    }

    /// Trains with `strategy`. On every rank but the lead, nothing is rendered or logged and
    /// burn-train's application log is not installed, so ranks never write to one file.
    fn with_data_parallel_strategy(self, strategy: DataParallelStrategy<LC>) -> Self;
}

impl<LC: LearningComponentsTypes + 'static> DataParallelTraining<LC> for SupervisedTraining<LC> {
    fn with_data_parallel_strategy(self, strategy: DataParallelStrategy<LC>) -> Self {
        let lead = strategy.is_lead();
        let training = self.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
        if lead {
            training
        } else {
            training
                .renderer(QuietRenderer)
                .with_metric_logger(QuietLogger)
                .with_application_logger(None)
        }
    }
}

/// `base` for rank 0 (its metrics, logs and checkpoints), `base/rank-R` for rank R: where each
/// rank's checkpoints go when every rank writes its own.
pub fn rank_directory(
    base: impl AsRef<std::path::Path>,
    comm: &Communicator,
) -> std::path::PathBuf {
    match comm.rank() {
        0 => base.as_ref().to_path_buf(),
        rank => base.as_ref().join(format!("rank-{rank}")),
    }
}
