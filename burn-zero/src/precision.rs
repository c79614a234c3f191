//! Mixed precision (Micikevicius et al., 2018; the ZeRO paper's setting): parameters and
//! gradients in a 16-bit dtype for compute, fp32 master weights and Adam moments in the
//! optimizer's shard, gradients optionally reduced in fp32, and, for f16, a dynamic loss scale
//! that keeps small gradients from underflowing and skips the steps whose gradients overflow.

use burn::config::Config;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, Tensor};
use burn_comm::{Communicator, ReduceOp};

use crate::ZeroError;

/// How the engine computes and reduces in 16 bits (PyTorch FSDP's `MixedPrecision`, DeepSpeed's
/// `bf16` and `fp16` sections).
#[derive(Config, Debug)]
pub struct MixedPrecision {
    /// The dtype of the parameters the forward and backward use: `BF16` or `F16`.
    pub param_dtype: DType,
    /// Reduce gradients in fp32 instead of `param_dtype`: twice the bytes on the wire and in
    /// the gradient buffers, no rounding of the sum to 16 bits.
    #[config(default = false)]
    pub reduce_f32: bool,
    /// Dynamic loss scaling; [`MixedPrecision::f16`] turns it on, bf16 has fp32's range and
    /// does not need it.
    #[config(default = "None")]
    pub loss_scale: Option<LossScaleConfig>,
}

impl MixedPrecision {
    /// bf16 parameters and gradients.
    pub fn bf16() -> Self {
        Self::new(DType::BF16)
    }

    /// f16 parameters and gradients, with dynamic loss scaling at PyTorch's defaults.
    pub fn f16() -> Self {
        Self::new(DType::F16).with_loss_scale(Some(LossScaleConfig::new()))
    }

    /// The dtype gradients are reduced and accumulated in.
    pub fn reduce_dtype(&self) -> DType {
        if self.reduce_f32 {
            DType::F32
        } else {
            self.param_dtype
        }
    }

    pub(crate) fn check(&self) -> Result<(), ZeroError> {
        if !matches!(self.param_dtype, DType::BF16 | DType::F16) {
            return Err(ZeroError::Config(format!(
                "mixed precision computes in bf16 or f16, not {:?}; leave it off for fp32 training",
                self.param_dtype
            )));
        }
        if let Some(scale) = &self.loss_scale {
            scale.check()?;
        }
        Ok(())
    }
}

/// Dynamic loss scaling (PyTorch's `GradScaler`, with its defaults): the loss is multiplied by
/// the scale before backward and the gradients divided by it before the step. A step whose
/// gradients hold inf or NaN on any rank is skipped on every rank and the scale shrinks; after
/// `growth_interval` good steps in a row it grows.
#[derive(Config, Debug)]
pub struct LossScaleConfig {
    /// The first scale.
    #[config(default = 65536.0)]
    pub init_scale: f64,
    /// The scale is multiplied by this after `growth_interval` good steps.
    #[config(default = 2.0)]
    pub growth_factor: f64,
    /// The scale is multiplied by this after a step with inf or NaN gradients.
    #[config(default = 0.5)]
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows.
    #[config(default = 2000)]
    pub growth_interval: usize,
}

impl LossScaleConfig {
    fn check(&self) -> Result<(), ZeroError> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.init_scale)
            || self.growth_factor < 1.0
            || !positive(self.backoff_factor)
            || self.backoff_factor >= 1.0
            || self.growth_interval == 0
        {
            return Err(ZeroError::Config(format!(
                "loss scaling needs init_scale > 0, growth_factor >= 1, 0 < backoff_factor < 1 and growth_interval >= 1; got {self:?}"
            )));
        }
        Ok(())
    }
}

/// What a step did.
#[must_use = "a skipped step should be reported"]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// The shard was updated and gathered.
    Applied,
    /// Gradients held inf or NaN on some rank: nothing changed but the loss scale.
    Skipped {
        /// The scale the overflowing gradients were computed with.
        loss_scale: f64,
        /// The scale from now on.
        next_loss_scale: f64,
    },
}

/// The running state of dynamic loss scaling.
#[derive(Debug, Clone)]
pub(crate) struct LossScaler {
    config: LossScaleConfig,
    scale: f64,
    good_steps: usize,
}

impl LossScaler {
    pub fn new(config: LossScaleConfig) -> Self {
        Self {
            scale: config.init_scale,
            config,
            good_steps: 0,
        }
    }

    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The running state, for a checkpoint.
    pub fn state(&self) -> crate::state::LossScaleState {
        crate::state::LossScaleState {
            scale: self.scale,
            good_steps: self.good_steps,
        }
    }

    /// Continues from a checkpoint's state.
    pub fn restore(&mut self, state: crate::state::LossScaleState) {
        self.scale = state.scale;
        self.good_steps = state.good_steps;
    }

    /// Records a step: grows the scale after enough good ones, shrinks it after a bad one.
    pub fn update(&mut self, overflowed: bool) -> StepOutcome {
        if overflowed {
            let loss_scale = self.scale;
            self.scale *= self.config.backoff_factor;
            self.good_steps = 0;
            return StepOutcome::Skipped {
                loss_scale,
                next_loss_scale: self.scale,
            };
        }
        self.good_steps += 1;
        if self.good_steps == self.config.growth_interval {
            self.scale *= self.config.growth_factor;
            self.good_steps = 0;
        }
        StepOutcome::Applied
    }
}

/// Whether `grad` (this rank's part) holds inf or NaN on any rank of `comm`: every rank gets
/// the same answer, so all skip or all step.
pub(crate) fn overflowed<B: Backend>(
    comm: &Communicator,
    grads: &[Tensor<B, 1>],
) -> Result<bool, ZeroError> {
    let bad = grads
        .iter()
        .map(|grad| grad.clone().is_finite().bool_not().any().float())
        .reduce(|a, b| a.max_pair(b))
        .expect("a shard has at least one part");
    let bad = comm.all_reduce(bad, ReduceOp::Max)?.into_scalar();
    Ok(bad.elem::<f32>() > 0.0)
}

/// `tensor` in `dtype` (no op when it is already).
pub(crate) fn cast<B: Backend, const D: usize>(tensor: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if tensor.dtype() == dtype {
        tensor
    } else {
        tensor.cast(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_backs_off_on_overflow_and_grows_after_the_interval() {
        let mut scaler = LossScaler::new(LossScaleConfig::new().with_growth_interval(2));
        assert_eq!(
            scaler.update(true),
            StepOutcome::Skipped {
                loss_scale: 65536.0,
                next_loss_scale: 32768.0
            }
        );
        assert_eq!(scaler.update(false), StepOutcome::Applied);
        assert_eq!(scaler.scale(), 32768.0);
        assert_eq!(scaler.update(false), StepOutcome::Applied);
        assert_eq!(scaler.scale(), 65536.0);
        // A bad step resets the run of good ones.
        let _ = scaler.update(false);
        let _ = scaler.update(true);
        let _ = scaler.update(false);
        assert_eq!(scaler.scale(), 32768.0);
    }

    #[test]
    fn only_16_bit_dtypes_and_sane_scales_are_accepted() {
        assert!(MixedPrecision::bf16().check().is_ok());
        assert!(MixedPrecision::f16().check().is_ok());
        let err = MixedPrecision::new(DType::F32).check().unwrap_err();
        assert!(err.to_string().contains("bf16 or f16"), "{err}");
        let bad = MixedPrecision::f16()
            .with_loss_scale(Some(LossScaleConfig::new().with_backoff_factor(1.5)));
        assert!(
            bad.check()
                .unwrap_err()
                .to_string()
                .contains("backoff_factor")
        );
    }
}
