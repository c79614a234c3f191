//! AdamW over one flat fp32 buffer (a ZeRO shard) in a single pass: on a cubecl device one
//! kernel reads the weights, gradient and both moments once and writes them back once, where
//! burn's AdamW runs about fifteen elementwise kernels, each a full pass over memory. Every
//! other backend, and the AdamW variants the kernel does not cover (AMSGrad, cautious weight
//! decay), get burn's own AdamW.

use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use crate::on_cube;

/// The constants of one AdamW step, in the element type and rounding burn's AdamW uses for
/// them, so the kernel's arithmetic is burn's, operation for operation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub beta_1: f32,
    /// `1 - beta_1`.
    pub factor_1: f32,
    pub beta_2: f32,
    /// `1 - beta_2`.
    pub factor_2: f32,
    /// The bias corrections `1 - beta^t` at this step.
    pub correction_1: f32,
    pub correction_2: f32,
    pub epsilon: f32,
    /// `1 - lr * weight_decay`: what decoupled weight decay multiplies the weights by.
    pub decay: f32,
    pub lr: f32,
}

/// The hyperparameters the kernel needs; `None` for the variants it does not cover.
#[derive(Debug, Clone, Copy)]
struct Hyper {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
}

impl Hyper {
    /// Read through serde: burn's `AdamWConfig` keeps its fields private.
    fn of(config: &AdamWConfig) -> Option<Self> {
        let value = serde_json::to_value(config).ok()?;
        let float = |name: &str| value.get(name)?.as_f64().map(|v| v as f32);
        let flag = |name: &str| value.get(name).and_then(|v| v.as_bool()).unwrap_or(false);
        if flag("amsgrad") || flag("cautious_weight_decay") {
            return None;
        }
        Some(Self {
            beta_1: float("beta_1")?,
            beta_2: float("beta_2")?,
            epsilon: float("epsilon")?,
            weight_decay: float("weight_decay")?,
        })
    }

    /// The constants of step `time` (1 for the first) at learning rate `lr`.
    fn step(&self, lr: f64, time: usize) -> AdamWStep {
        let time = time as i32;
        AdamWStep {
            beta_1: self.beta_1,
            factor_1: 1.0 - self.beta_1,
            beta_2: self.beta_2,
            factor_2: 1.0 - self.beta_2,
            correction_1: 1.0 - self.beta_1.powi(time),
            correction_2: 1.0 - self.beta_2.powi(time),
            epsilon: self.epsilon,
            decay: (1.0 - lr * self.weight_decay as f64) as f32,
            lr: lr as f32,
        }
    }
}

/// AdamW as `config` describes it, stepping flat 1-d buffers: fused on a cubecl device, burn's
/// AdamW elsewhere. Gradient clipping in `config` is not applied here (the caller clips).
#[derive(Clone)]
pub struct FusedAdamW {
    adamw: AdamW,
    hyper: Option<Hyper>,
}

impl FusedAdamW {
    pub fn new(config: &AdamWConfig) -> Self {
        Self {
            adamw: config.build(),
            hyper: Hyper::of(config),
        }
    }

    /// Whether a step of `B`'s tensors runs the fused kernel (rather than burn's AdamW).
    pub fn is_fused<B: Backend>(&self) -> bool {
        self.hyper.is_some() && crate::has_kernels::<B>()
    }

    /// The constants the kernel gets at step `time` (1 for the first), or `None` for the
    /// variants it does not cover.
    pub fn constants(&self, lr: f64, time: usize) -> Option<AdamWStep> {
        self.hyper.map(|h| h.step(lr, time))
    }

    /// One step of `weights` with `grad`, from `state` (`None` before the first): the
    /// updated weights and state, as burn's AdamW gives them.
    pub fn step<B: Backend>(
        &self,
        lr: f64,
        weights: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        state: Option<AdamWState<B, 1>>,
    ) -> (Tensor<B, 1>, AdamWState<B, 1>) {
        let fusable = [weights.dtype(), grad.dtype()] == [DType::F32; 2];
        match self.hyper {
            Some(hyper) if fusable && self.is_fused::<B>() => {
                let state = state.map(|s| s.momentum).unwrap_or_else(|| {
                    let zeros = || weights.zeros_like();
                    AdaptiveMomentumState::new(0, zeros(), zeros())
                });
                let time = state.time + 1;
                let constants = hyper.step(lr, time);
                let [weights, moment_1, moment_2] =
                    fused_step(constants, weights, grad, state.moment_1, state.moment_2);
                let momentum = AdaptiveMomentumState::new(time, moment_1, moment_2);
                (weights, AdamWState::new(momentum))
            }
            _ => {
                let (weights, state) = self.adamw.step(lr, weights, grad, state);
                (weights, state.expect("AdamW always returns its state"))
            }
        }
    }
}

/// The fused step on `B`'s cubecl runtime; the plain-burn fallback elsewhere.
pub fn fused_step<B: Backend>(
    step: AdamWStep,
    weights: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    moment_1: Tensor<B, 1>,
    moment_2: Tensor<B, 1>,
) -> [Tensor<B, 1>; 3] {
    on_cube!(B, kernel::step(step, weights, grad, moment_1, moment_2));
    fallback_step(step, weights, grad, moment_1, moment_2)
}

/// [`fused_step`] in burn's tensor operations, in the kernel's order (burn's AdamW's).
pub fn fallback_step<B: Backend>(
    step: AdamWStep,
    weights: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    moment_1: Tensor<B, 1>,
    moment_2: Tensor<B, 1>,
) -> [Tensor<B, 1>; 3] {
    let moment_1 = moment_1.mul_scalar(step.beta_1) + grad.clone().mul_scalar(step.factor_1);
    let moment_2 = moment_2.mul_scalar(step.beta_2) + grad.square().mul_scalar(step.factor_2);
    let corrected_1 = moment_1.clone().div_scalar(step.correction_1);
    let corrected_2 = moment_2.clone().div_scalar(step.correction_2);
    let delta = corrected_1 / corrected_2.sqrt().add_scalar(step.epsilon);
    let weights = weights.mul_scalar(step.decay) - delta.mul_scalar(step.lr);
    [weights, moment_1, moment_2]
}

#[cfg(feature = "cubecl")]
mod kernel {
    use burn::tensor::Tensor;
    use burn::tensor::backend::Backend;
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;
    use cubecl::{calculate_cube_count_elemwise, frontend::Array};

    use super::AdamWStep;
    use crate::cube::{from_cube, into_cube};

    #[cube(launch, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        weights: &mut Array<f32>,
        grad: &Array<f32>,
        moment_1: &mut Array<f32>,
        moment_2: &mut Array<f32>,
        beta_1: f32,
        factor_1: f32,
        beta_2: f32,
        factor_2: f32,
        correction_1: f32,
        correction_2: f32,
        epsilon: f32,
        decay: f32,
        lr: f32,
    ) {
        let i = ABSOLUTE_POS;
        if i >= weights.len() {
            terminate!();
        }
        let g = grad[i];
        let m = moment_1[i] * beta_1 + g * factor_1;
        let v = moment_2[i] * beta_2 + g * g * factor_2;
        moment_1[i] = m;
        moment_2[i] = v;
        let delta = (m / correction_1) / (f32::sqrt(v / correction_2) + epsilon);
        weights[i] = weights[i] * decay - delta * lr;
    }

    /// A buffer the kernel may overwrite: `tensor`'s own when nothing else holds it.
    fn writable<R: CubeRuntime>(tensor: CubeTensor<R>) -> CubeTensor<R> {
        let tensor = into_contiguous(tensor);
        if tensor.can_mut() {
            tensor
        } else {
            tensor.copy()
        }
    }

    pub(super) fn step<B: Backend, R: CubeRuntime>(
        step: AdamWStep,
        weights: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        moment_1: Tensor<B, 1>,
        moment_2: Tensor<B, 1>,
    ) -> [Tensor<B, 1>; 3] {
        let len = weights.dims()[0];
        for (name, other) in [
            ("gradient", &grad),
            ("first moment", &moment_1),
            ("second moment", &moment_2),
        ] {
            assert_eq!(
                other.dims()[0],
                len,
                "AdamW: the {name} has {} elements, the weights {len}",
                other.dims()[0]
            );
        }
        if len == 0 {
            return [weights, moment_1, moment_2];
        }
        let weights = writable(into_cube::<B, R, 1>(weights));
        let moment_1 = writable(into_cube::<B, R, 1>(moment_1));
        let moment_2 = writable(into_cube::<B, R, 1>(moment_2));
        let grad = into_contiguous(into_cube::<B, R, 1>(grad));
        let client = weights.client.clone();
        let cube_dim = CubeDim::new(&client, len);
        let cube_count = calculate_cube_count_elemwise(&client, len, cube_dim);
        let address = [&weights, &grad, &moment_1, &moment_2]
            .into_iter()
            .map(|t| t.required_address_type())
            .max()
            .expect("four tensors");
        let array = |t: &CubeTensor<R>| t.clone().into_array_arg();
        adamw::launch(
            &client,
            cube_count,
            cube_dim,
            address,
            array(&weights),
            array(&grad),
            array(&moment_1),
            array(&moment_2),
            step.beta_1,
            step.factor_1,
            step.beta_2,
            step.factor_2,
            step.correction_1,
            step.correction_2,
            step.epsilon,
            step.decay,
            step.lr,
        );
        [weights, moment_1, moment_2].map(from_cube::<B, R, 1>)
    }
}
