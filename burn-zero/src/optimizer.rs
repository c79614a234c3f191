//! AdamW on one rank's shard: burn's own AdamW step, applied to the flat fp32 shard instead of
//! to each parameter. Its arithmetic is elementwise, so every element gets exactly the update
//! a whole-model AdamW gives it.

use burn::backend::Flex;
use burn::optim::{AdamW, AdamWConfig, AdamWState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// The optimizer state of one rank's shard: first and second moments, fp32.
pub struct ShardedAdamW<B: Backend> {
    adamw: AdamW,
    state: Option<AdamWState<B, 1>>,
}

impl<B: Backend> ShardedAdamW<B> {
    /// AdamW as `config` describes it. Gradient clipping in `config` is not applied: burn
    /// clips each parameter's gradient on its own, which a shard cannot reproduce.
    pub fn new(config: &AdamWConfig) -> Self {
        Self {
            adamw: config.build(),
            state: None,
        }
    }

    /// One step of the shard: `master` (fp32 weights) updated with `grad` (fp32).
    pub fn step(&mut self, lr: f64, master: Tensor<B, 1>, grad: Tensor<B, 1>) -> Tensor<B, 1> {
        let (master, state) = self.adamw.step(lr, master, grad, self.state.take());
        self.state = state;
        master
    }

    /// Steps taken so far.
    pub fn steps(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.momentum.time)
    }

    /// Bytes of optimizer state held (none before the first step).
    pub fn state_bytes(&self) -> usize {
        let Some(state) = &self.state else {
            return 0;
        };
        let m = &state.momentum;
        [
            Some(&m.moment_1),
            Some(&m.moment_2),
            m.max_moment_2.as_ref(),
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
    if tensor.dtype() == DType::F32 {
        tensor
    } else {
        tensor.cast(DType::F32)
    }
}

/// A shard's AdamW where it runs: on the model's device, or offloaded (ZeRO-Offload) to host
/// memory, where the state stays and the step runs on burn's CPU backend; the shard's
/// weights and gradients cross once each way per step.
pub(crate) enum PlacedAdamW<B: Backend> {
    Device(ShardedAdamW<B>),
    Host(Box<ShardedAdamW<Flex>>),
}

impl<B: Backend> PlacedAdamW<B> {
    pub fn new(config: &AdamWConfig, offload: bool) -> Self {
        if offload {
            Self::Host(Box::new(ShardedAdamW::new(config)))
        } else {
            Self::Device(ShardedAdamW::new(config))
        }
    }

    /// [`ShardedAdamW::step`], the result on `master`'s device.
    pub fn step(&mut self, lr: f64, master: Tensor<B, 1>, grad: Tensor<B, 1>) -> Tensor<B, 1> {
        match self {
            Self::Device(adamw) => adamw.step(lr, master, grad),
            Self::Host(adamw) => {
                let device = master.device();
                let host = Default::default();
                let master = Tensor::from_data(master.into_data(), &host);
                let grad = Tensor::from_data(grad.into_data(), &host);
                Tensor::from_data(adamw.step(lr, master, grad).into_data(), &device)
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
