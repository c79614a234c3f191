//! Clipping by the global norm of every gradient of the model together (PyTorch's
//! `clip_grad_norm_`, DeepSpeed's and Megatron's `gradient_clipping`), as Llama-style training
//! uses it. burn's own clipping works on each parameter alone.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};

use crate::params::trainable;

/// The factor gradients of global norm `norm` are multiplied by: `max_norm / (norm + 1e-6)`,
/// as PyTorch computes it, or None when that is 1 or more (no scaling); NaN for a non-finite
/// norm, so a broken step does not pass unnoticed.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    match norm.is_finite() {
        true => Some(max_norm / (norm + 1e-6)).filter(|&c| c < 1.0),
        false => Some(f64::NAN),
    }
}

/// Scales `grads` (of `module`'s trainable parameters, each whole on this rank) so their
/// global L2 norm is at most `max_norm`; returns them with the norm they had. A non-finite
/// norm makes every gradient NaN.
pub fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: f64,
) -> (GradientsParams, f64) {
    let slots = trainable::<B, M>(module);
    let taken: Vec<_> = slots
        .iter()
        .map(|slot| (slot.take_param)(&mut grads))
        .collect();
    let squares: Vec<Tensor<B::InnerBackend, 1>> = taken
        .iter()
        .flatten()
        .map(|g| g.clone().cast(DType::F32).powi_scalar(2).sum())
        .collect();
    let norm = match squares.is_empty() {
        true => 0.0,
        false => Tensor::cat(squares, 0)
            .sum()
            .into_scalar()
            .elem::<f64>()
            .sqrt(),
    };
    let coefficient = clip_coefficient(norm, max_norm);
    for (slot, grad) in slots.iter().zip(taken) {
        if let Some(grad) = grad {
            let grad = match coefficient {
                Some(c) => grad * c,
                None => grad,
            };
            (slot.put)(&mut grads, grad);
        }
    }
    (grads, norm)
}
