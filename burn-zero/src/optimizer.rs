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
use crate::state::StateTensor;

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

/// Each part's step count and two moments, as `held` wraps them; none before the first step.
#[allow(clippy::type_complexity)]
fn held_moments<C: Backend, B: Backend>(
    adamws: &[ShardedAdamW<C>],
    held: fn(Tensor<C, 1>) -> StateTensor<B>,
) -> Option<Vec<(usize, StateTensor<B>, StateTensor<B>)>> {
    adamws
        .iter()
        .map(|a| {
            let m = &a.state()?.momentum;
            Some((m.time, held(m.moment_1.clone()), held(m.moment_2.clone())))
        })
        .collect()
}

/// A shard's AdamW where it runs, one [`ShardedAdamW`] per unit's part: on the model's device,
/// or offloaded (ZeRO-Offload) to host memory, where the state stays and the step runs on
/// burn's CPU backend; the shard's weights and gradients cross once each way per step.
///
/// Stepping each part on its own keeps every buffer of the step the size of one unit's part:
/// stepped whole, a shard of a few tens of MB made each of the step's temporaries an allocation
/// that the CPU allocator maps fresh (a page fault per page) and unmaps again every step.
pub(crate) enum PlacedAdamW<B: Backend> {
    Device(Vec<ShardedAdamW<B>>),
    Host(Vec<ShardedAdamW<Flex>>),
}

impl<B: Backend> PlacedAdamW<B> {
    /// AdamW for `parts` unit parts, on the device or in host memory (`offload`), holding
    /// `master` (fp32, this rank's parts) between steps when given.
    pub fn new(
        config: &AdamWConfig,
        offload: bool,
        parts: usize,
        master: Option<Vec<Tensor<B, 1>>>,
    ) -> Result<Self, ZeroError> {
        if master.as_ref().is_some_and(|m| m.len() != parts) {
            return Err(ZeroError::Config(format!(
                "master weights for {} parts of a shard of {parts}",
                master.as_ref().map_or(0, Vec::len)
            )));
        }
        Ok(match offload {
            true => Self::Host(per_part(config, parts, master, to_host)?),
            false => Self::Device(per_part(config, parts, master, |t| t)?),
        })
    }

    /// [`ShardedAdamW::step`] of every part with its gradient in `grads` (fp32), the results
    /// on the gradients' device. `weights` (the parameters' parts, fp32) is called only when
    /// no master weights are held.
    pub fn step(
        &mut self,
        lr: f64,
        grads: Vec<Tensor<B, 1>>,
        weights: impl FnOnce() -> Vec<Tensor<B, 1>>,
    ) -> Vec<Tensor<B, 1>> {
        assert_eq!(
            grads.len(),
            self.parts(),
            "a gradient per part of the shard"
        );
        let held = match self {
            Self::Device(adamws) => adamws.first().is_some_and(|a| a.master().is_some()),
            Self::Host(adamws) => adamws.first().is_some_and(|a| a.master().is_some()),
        };
        let mut weights = (!held).then(|| weights().into_iter());
        let mut next_weights = move || {
            weights
                .as_mut()
                .and_then(Iterator::next)
                .expect("the parameters' parts, one per unit")
        };
        match self {
            Self::Device(adamws) => adamws
                .iter_mut()
                .zip(grads)
                .map(|(adamw, grad)| adamw.step(lr, grad, &mut next_weights))
                .collect(),
            Self::Host(adamws) => adamws
                .iter_mut()
                .zip(grads)
                .map(|(adamw, grad)| {
                    let device = grad.device();
                    let updated = adamw.step(lr, to_host(grad), || to_host(next_weights()));
                    Tensor::from_data(updated.into_data(), &device)
                })
                .collect(),
        }
    }

    /// The held fp32 master weights, part by part, wherever they are, on `device`.
    pub fn master(&self, device: &B::Device) -> Option<Vec<Tensor<B, 1>>> {
        match self {
            Self::Device(adamws) => adamws.iter().map(|a| a.master().cloned()).collect(),
            Self::Host(adamws) => adamws
                .iter()
                .map(|a| a.master().map(|m| Tensor::from_data(m.to_data(), device)))
                .collect(),
        }
    }

    /// The held fp32 master weights, part by part, where they are held (not moved).
    pub fn held_master(&self) -> Option<Vec<StateTensor<B>>> {
        match self {
            Self::Device(adamws) => adamws
                .iter()
                .map(|a| a.master().cloned().map(StateTensor::Device))
                .collect(),
            Self::Host(adamws) => adamws
                .iter()
                .map(|a| a.master().cloned().map(StateTensor::Host))
                .collect(),
        }
    }

    /// The step count and each part's two moments, once a step has made them, where they are
    /// held: moving offloaded moments to the device would take device memory the offload saves.
    pub fn held_state(&self) -> Option<(usize, [Vec<StateTensor<B>>; 2])> {
        let parts = match self {
            Self::Device(adamws) => held_moments(adamws, StateTensor::Device)?,
            Self::Host(adamws) => held_moments(adamws, StateTensor::Host)?,
        };
        let time = parts.first().map_or(0, |p| p.0);
        let (first, second) = parts.into_iter().map(|(_, m1, m2)| (m1, m2)).unzip();
        Some((time, [first, second]))
    }

    /// How many parts of the shard it steps.
    fn parts(&self) -> usize {
        match self {
            Self::Device(adamws) => adamws.len(),
            Self::Host(adamws) => adamws.len(),
        }
    }

    /// Replaces the step count and each part's moments (a checkpoint's), or clears them.
    pub fn set_state(&mut self, state: Option<(usize, [Vec<Tensor<B, 1>>; 2])>) {
        if let Some((_, [first, second])) = &state {
            let parts = self.parts();
            assert!(
                first.len() == parts && second.len() == parts,
                "moments per part"
            );
        }
        match self {
            Self::Device(adamws) => restore(adamws, state, |t| t),
            Self::Host(adamws) => restore(adamws, state, to_host),
        }
    }

    /// Bytes of optimizer state on the device, and in host memory.
    pub fn state_bytes(&self) -> (usize, usize) {
        match self {
            Self::Device(adamws) => (adamws.iter().map(ShardedAdamW::state_bytes).sum(), 0),
            Self::Host(adamws) => (0, adamws.iter().map(ShardedAdamW::state_bytes).sum()),
        }
    }
}

/// One AdamW per part on backend `C`, each holding its part of `master` (moved there by
/// `place`) when given.
fn per_part<B: Backend, C: Backend>(
    config: &AdamWConfig,
    parts: usize,
    master: Option<Vec<Tensor<B, 1>>>,
    place: impl Fn(Tensor<B, 1>) -> Tensor<C, 1>,
) -> Result<Vec<ShardedAdamW<C>>, ZeroError> {
    let mut master = master.map(Vec::into_iter);
    (0..parts)
        .map(|_| {
            let adamw = ShardedAdamW::new(config)?;
            Ok(match master.as_mut().and_then(Iterator::next) {
                Some(part) => adamw.with_master(place(part)),
                None => adamw,
            })
        })
        .collect()
}

/// `adamws` continuing from `state` (the step count and each part's moments, moved to them by
/// `place`), or with no moments.
fn restore<B: Backend, C: Backend>(
    adamws: &mut [ShardedAdamW<C>],
    state: Option<(usize, [Vec<Tensor<B, 1>>; 2])>,
    place: impl Fn(Tensor<B, 1>) -> Tensor<C, 1>,
) {
    let mut moments = state.map(|(time, [first, second])| {
        first
            .into_iter()
            .zip(second)
            .map(move |(m1, m2)| (time, m1, m2))
    });
    for adamw in adamws {
        let state = moments
            .as_mut()
            .and_then(Iterator::next)
            .map(|(time, m1, m2)| AdamWState {
                momentum: AdaptiveMomentumState::new(time, place(m1), place(m2)),
            });
        *adamw = adamw.clone().with_state(state);
    }
}

pub(crate) fn to_host<B: Backend>(tensor: Tensor<B, 1>) -> Tensor<Flex, 1> {
    let dtype = tensor.dtype();
    Tensor::from_data(tensor.into_data(), (&Default::default(), dtype))
}
