//! Clipping by the global norm of the whole gradient, from each rank's part of it: one
//! all-reduce of the parts' sums of squares (DeepSpeed's `gradient_clipping` under ZeRO).

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::clip_coefficient;

use crate::ZeroError;

/// `grads`, the parts of this rank's fp32 share of the whole gradient, scaled so the whole has
/// an L2 norm of at most `max_norm`, with the whole's norm before; `grads` as they are without
/// `max_norm`.
pub(crate) fn clip_global_norm<B: Backend>(
    comm: &Communicator,
    grads: Vec<Tensor<B, 1>>,
    max_norm: Option<f64>,
) -> Result<(Vec<Tensor<B, 1>>, Option<f64>), ZeroError> {
    let Some(max_norm) = max_norm else {
        return Ok((grads, None));
    };
    let squares = grads
        .iter()
        .map(|grad| grad.clone().powi_scalar(2).sum())
        .reduce(|a, b| a + b)
        .expect("a shard has at least one part");
    let norm = comm
        .all_reduce(squares, ReduceOp::Sum)?
        .into_scalar()
        .elem::<f64>()
        .sqrt();
    let grads = match clip_coefficient(norm, max_norm) {
        Some(c) => grads.into_iter().map(|grad| grad * c).collect(),
        None => grads,
    };
    Ok((grads, Some(norm)))
}

#[cfg(test)]
mod tests {
    use crate::ZeroConfig;

    #[test]
    fn only_a_positive_finite_norm_is_accepted() {
        assert!(ZeroConfig::new().check().is_ok());
        assert!(
            ZeroConfig::new()
                .with_max_grad_norm(Some(1.0))
                .check()
                .is_ok()
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let error = ZeroConfig::new()
                .with_max_grad_norm(Some(bad))
                .check()
                .unwrap_err()
                .to_string();
            assert!(error.contains("positive finite norm"), "{error}");
        }
    }
}
