//! Backward with the gradient all-reduce overlapped, for a user's `TrainStep`. burn-train runs
//! backward inside the user's code, so the strategy lends this rank's [`GradientSync`] to the
//! thread for the step, and [`backward`] uses it when it is there.

use std::any::Any;
use std::cell::RefCell;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_ddp::{BackwardHooks, DdpStepStats, GradientSync};
use burn_train::TrainOutput;

thread_local! {
    /// This rank's synchronisation, lent by the strategy for one training step.
    static LENT: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
    /// Whether the step's gradients were averaged during backward.
    static AVERAGED: RefCell<bool> = const { RefCell::new(false) };
    /// Timings of this rank's last gradient synchronisation.
    static LAST_STATS: RefCell<Option<DdpStepStats>> = const { RefCell::new(None) };
}

/// Backward of `loss`, computed from `module`, as a `TrainOutput`: use it in `TrainStep::step`
/// in place of `TrainOutput::new(module, loss.backward(), item)`.
///
/// Under [`crate::DataParallelStrategy`] (without gradient accumulation) the gradients are
/// averaged over the group in buckets whose all-reduce starts during backward, as PyTorch DDP
/// does; anywhere else it is exactly burn's plain backward.
pub fn backward<B, M, T>(module: &M, loss: Tensor<B, 1>, item: T) -> TrainOutput<T>
where
    B: BackwardHooks,
    M: AutodiffModule<B>,
{
    let lent = LENT.with(|l| l.borrow_mut().take());
    let grads = match lent.map(|sync| sync.downcast::<GradientSync<B>>()) {
        Some(Ok(mut sync)) => {
            let grads = sync.backward(module, loss).unwrap_or_else(|e| {
                panic!(
                    "data-parallel backward failed on rank {} of {}: {e}",
                    sync.comm().rank(),
                    sync.comm().size()
                )
            });
            AVERAGED.with(|a| *a.borrow_mut() = true);
            LENT.with(|l| *l.borrow_mut() = Some(sync));
            grads
        }
        // Another backend's synchronisation: leave it for the strategy, which averages after.
        Some(Err(other)) => {
            LENT.with(|l| *l.borrow_mut() = Some(other));
            GradientsParams::from_grads(loss.backward(), module)
        }
        None => GradientsParams::from_grads(loss.backward(), module),
    };
    TrainOutput { grads, item }
}

/// Lends `sync` to this thread for one step.
pub(crate) fn lend<B: AutodiffBackend>(sync: GradientSync<B>) {
    AVERAGED.with(|a| *a.borrow_mut() = false);
    LENT.with(|l| *l.borrow_mut() = Some(Box::new(sync)));
}

/// Takes the lent synchronisation back, with whether [`backward`] averaged the step.
pub(crate) fn reclaim<B: AutodiffBackend>() -> (GradientSync<B>, bool) {
    let sync = LENT
        .with(|l| l.borrow_mut().take())
        .and_then(|s| s.downcast::<GradientSync<B>>().ok())
        .expect("the synchronisation lent for the step is back");
    (*sync, AVERAGED.with(|a| a.replace(false)))
}

pub(crate) fn record(stats: DdpStepStats) {
    LAST_STATS.with(|s| *s.borrow_mut() = Some(stats));
}

/// Timings of this rank's last gradient synchronisation under
/// [`crate::DataParallelStrategy`]: how long backward took, how long the step waited for
/// communication after it, and how many buckets started during backward (none unless the
/// `TrainStep` uses [`backward`]). Call it on the rank's thread.
pub fn last_sync_stats() -> Option<DdpStepStats> {
    LAST_STATS.with(|s| *s.borrow())
}
