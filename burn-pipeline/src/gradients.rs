//! Where a pipeline step's weight gradients go. The executor runs each chunk's backwards
//! through a [`GradientSink`] and tells it which is the chunk's last of the step, so a sink
//! that averages over data-parallel replicas can start a chunk's buckets during its last
//! backward, while the pipeline still drains (Megatron does the same with its
//! `is_last_microbatch`). [`Accumulate`] only sums them, for a pipeline without replicas.

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_ddp::{BackwardHooks, SyncStep};

use crate::PipelineError;

/// Receives the weight gradients of a pipeline step, chunk by chunk.
pub trait GradientSink<B: AutodiffBackend, M: AutodiffModule<B>> {
    /// What every loss is multiplied by before its backward (f16 loss scaling); 1 by default.
    fn loss_scale(&self) -> f64 {
        1.0
    }

    /// Backward of `target`, one micro-batch's contribution to `chunk`'s parameters; `last`
    /// when no later micro-batch of this step adds to them. Takes the parameters' gradients and
    /// returns the rest: the gradient of the chunk's input, which the executor sends on.
    fn backward(
        &mut self,
        chunk: &M,
        target: Tensor<B, 1>,
        last: bool,
    ) -> Result<B::Gradients, PipelineError>;
}

/// Sums each chunk's gradients over the micro-batches, on this rank only.
pub struct Accumulate<M> {
    accumulator: GradientsAccumulator<M>,
    loss_scale: f64,
}

impl<M> Accumulate<M> {
    /// An empty sum for a step whose losses are multiplied by `loss_scale`.
    pub fn new(loss_scale: f64) -> Self {
        Self {
            accumulator: GradientsAccumulator::new(),
            loss_scale,
        }
    }

    /// The step's gradients, summed.
    pub fn grads(&mut self) -> GradientsParams {
        self.accumulator.grads()
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> GradientSink<B, M> for Accumulate<M> {
    fn loss_scale(&self) -> f64 {
        self.loss_scale
    }

    fn backward(
        &mut self,
        chunk: &M,
        target: Tensor<B, 1>,
        _last: bool,
    ) -> Result<B::Gradients, PipelineError> {
        let mut grads = target.backward();
        let params = GradientsParams::from_module(&mut grads, chunk);
        self.accumulator.accumulate(chunk, params);
        Ok(grads)
    }
}

/// Averages over the data-parallel replicas of the pipeline's stages (dp x pp): earlier
/// micro-batches are summed locally, and a chunk's last backward starts the buckets that its
/// gradients complete, overlapping the rest of the step.
impl<B: BackwardHooks, M: AutodiffModule<B>> GradientSink<B, M> for SyncStep<'_, B> {
    fn backward(
        &mut self,
        chunk: &M,
        target: Tensor<B, 1>,
        last: bool,
    ) -> Result<B::Gradients, PipelineError> {
        if last {
            return Ok(self.backward_of(chunk, target));
        }
        let mut grads = target.backward();
        self.accumulate(chunk, &mut grads);
        Ok(grads)
    }
}
