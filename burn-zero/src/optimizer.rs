//! AdamW on one rank's shard: burn's AdamW step applied to the flat fp32 shard instead of to
//! each parameter. Its arithmetic is elementwise, so every element gets exactly the update a
//! whole-model AdamW gives it. On a cubecl device the step is one fused kernel
//! ([`burn_kernels::FusedAdamW`]).

use burn::backend::Flex;
use burn::optim::{AdamWConfig, AdamWState, AdaptiveMomentumState};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_kernels::FusedAdamW;

use crate::ZeroError;
use crate::precision::cast;

/// The optimizer state of one rank's shard: first and second moments, fp32, and the fp32
/// master weights when the parameters are kept in 16 bits.
#[derive(Clone)]
pub struct ShardedAdamW<B: Backend> {
    adamw: FusedAdamW,
    state: Option<AdamWState<B, 1>>,
    master: Option<Tensor<B, 1>>,
}

impl<B: Backend> ShardedAdamW<B> {
    /// AdamW as `config` describes it. A config with gradient clipping is refused: burn clips
    /// each parameter's gradient on its own, which a shard of a flat buffer cannot reproduce,
    /// and ignoring it would train differently without a word. The engines clip by the global
    /// norm instead ([`ZeroConfig::max_grad_norm`](crate::ZeroConfig::max_grad_norm)).
    pub fn new(config: &AdamWConfig) -> Result<Self, ZeroError> {
        let clipping = serde_json::to_value(config)
            .ok()
            .and_then(|c| c.get("grad_clipping").cloned())
            .is_some_and(|c| !c.is_null());
        if clipping {
            return Err(ZeroError::Config(
                "the AdamW config clips gradients, which burn does per parameter and a rank holding a shard cannot; remove grad_clipping and clip by the global norm with ZeroConfig::max_grad_norm".into(),
            ));
        }
        Ok(Self {
            adamw: FusedAdamW::new(config),
            state: None,
            master: None,
        })
    }

    /// Keeps `master` (fp32) as the shard's weights between steps: for parameters held in 16
    /// bits, whose rounding would otherwise swallow updates smaller than their precision.
    pub fn with_master(mut self, master: Tensor<B, 1>) -> Self {
        self.master = Some(to_f32(master));
        self
    }

    /// One step of the shard with `grad` (fp32): of the held master weights, or else of
    /// `weights()` (the parameters, fp32). Returns the updated fp32 weights.
    pub fn step(
        &mut self,
        lr: f64,
        grad: Tensor<B, 1>,
        weights: impl FnOnce() -> Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        let held = self.master.take();
        let keep = held.is_some();
        let weights = held.unwrap_or_else(|| to_f32(weights()));
        let (updated, state) = self.adamw.step(lr, weights, grad, self.state.take());
        self.state = Some(state);
        if keep {
            self.master = Some(updated.clone());
        }
        updated
    }

    /// The moments, once a step has made them.
    pub fn state(&self) -> Option<&AdamWState<B, 1>> {
        self.state.as_ref()
    }

    /// Replaces the moments (a checkpoint's).
    pub fn with_state(mut self, state: Option<AdamWState<B, 1>>) -> Self {
        self.state = state;
        self
    }

    /// Steps taken so far.
    pub fn steps(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.momentum.time)
    }

    /// The held fp32 master weights, if any.
    pub fn master(&self) -> Option<&Tensor<B, 1>> {
        self.master.as_ref()
    }

    /// Bytes of optimizer state held: the master weights, and the moments (none before the
    /// first step).
    pub fn state_bytes(&self) -> usize {
        let m = self.state.as_ref().map(|s| &s.momentum);
        [
            self.master.as_ref(),
            m.map(|m| &m.moment_1),
            m.map(|m| &m.moment_2),
            m.and_then(|m| m.max_moment_2.as_ref()),
        ]
        .into_iter()
        .flatten()
        .map(bytes)
        .sum()
    }
}

/// Bytes of a tensor's elements.
pub fn bytes<B: Backend, const D: usize>(tensor: &Tensor<B, D>) -> usize {
    tensor.shape().num_elements() * tensor.dtype().size()
}

/// `tensor` as fp32 (the dtype of master weights, optimizer state and the step).
pub fn to_f32<B: Backend>(tensor: Tensor<B, 1>) -> Tensor<B, 1> {
    cast(tensor, DType::F32)
}

/// A shard's AdamW where it runs: on the model's device, or offloaded (ZeRO-Offload) to host
/// memory, where the state stays and the step runs on burn's CPU backend; the shard's
/// weights and gradients cross once each way per step.
pub(crate) enum PlacedAdamW<B: Backend> {
    Device(ShardedAdamW<B>),
    Host(Box<ShardedAdamW<Flex>>),
}

impl<B: Backend> PlacedAdamW<B> {
    /// AdamW on the device or in host memory (`offload`), holding `master` (fp32, this rank's
    /// shard) between steps when given.
    pub fn new(
        config: &AdamWConfig,
        offload: bool,
        master: Option<Tensor<B, 1>>,
    ) -> Result<Self, ZeroError> {
        Ok(if offload {
            let mut adamw = ShardedAdamW::new(config)?;
            if let Some(master) = master {
                adamw = adamw.with_master(to_host(master));
            }
            Self::Host(Box::new(adamw))
        } else {
            let mut adamw = ShardedAdamW::new(config)?;
            if let Some(master) = master {
                adamw = adamw.with_master(master);
            }
            Self::Device(adamw)
        })
    }

    /// [`ShardedAdamW::step`], the result on `grad`'s device.
    pub fn step(
        &mut self,
        lr: f64,
        grad: Tensor<B, 1>,
        weights: impl FnOnce() -> Tensor<B, 1>,
    ) -> Tensor<B, 1> {
        match self {
            Self::Device(adamw) => adamw.step(lr, grad, weights),
            Self::Host(adamw) => {
                let device = grad.device();
                let updated = adamw.step(lr, to_host(grad), || to_host(weights()));
                Tensor::from_data(updated.into_data(), &device)
            }
        }
    }

    /// The held fp32 master weights, wherever they are, on `device`.
    pub fn master(&self, device: &B::Device) -> Option<Tensor<B, 1>> {
        match self {
            Self::Device(adamw) => adamw.master().cloned(),
            Self::Host(adamw) => adamw
                .master()
                .map(|m| Tensor::from_data(m.to_data(), device)),
        }
    }

    /// The moments and step count, once a step has made them, on `device`.
    pub fn state(&self, device: &B::Device) -> Option<AdamWState<B, 1>> {
        match self {
            Self::Device(adamw) => adamw.state().cloned(),
            Self::Host(adamw) => adamw.state().map(|state| {
                let m = &state.momentum;
                let moved = |t: &Tensor<Flex, 1>| Tensor::from_data(t.to_data(), device);
                AdamWState {
                    momentum: AdaptiveMomentumState::new(
                        m.time,
                        moved(&m.moment_1),
                        moved(&m.moment_2),
                    ),
                }
            }),
        }
    }

    /// Replaces the moments and step count (a checkpoint's).
    pub fn set_state(&mut self, state: Option<AdamWState<B, 1>>) {
        match self {
            Self::Device(adamw) => *adamw = adamw.clone().with_state(state),
            Self::Host(adamw) => {
                let state = state.map(|state| {
                    let m = state.momentum;
                    AdamWState {
                        momentum: AdaptiveMomentumState::new(
                            m.time,
                            to_host(m.moment_1),
                            to_host(m.moment_2),
                        ),
                    }
                });
                **adamw = adamw.clone().with_state(state);
            }
        }
    }

    /// Bytes of optimizer state on the device, and in host memory.
    pub fn state_bytes(&self) -> (usize, usize) {
        match self {
            Self::Device(adamw) => (adamw.state_bytes(), 0),
            Self::Host(adamw) => (0, adamw.state_bytes()),
        }
    }
}

fn to_host<B: Backend>(tensor: Tensor<B, 1>) -> Tensor<Flex, 1> {
    Tensor::from_data(tensor.into_data(), &Default::default())
}
