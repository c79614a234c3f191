//! A ZeRO engine's training state as a checkpoint keeps it: per parameter, the elements this
//! rank's shard holds (a flat range of the parameter, row-major), their fp32 weights and AdamW
//! moments; the optimizer's step count and the loss scaler. A resumed engine is built from a
//! model holding the saved weights, then given the moments and the rest back.

use std::ops::Range;

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::ZeroError;
use crate::flat::FlatLayout;
use crate::optimizer::{PlacedAdamW, to_host};
use crate::precision::LossScaler;

/// The elements `range` (row-major) of the parameter `name` shaped `shape`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamRange {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
}

/// A rank's part of a ZeRO engine's state. `V` holds the values of one range: host data (what
/// `shard_state` gives), or a [`StateTensor`] where the engine holds it (what `shard_tensors`
/// gives, for a save that reads it later), most of them views of the engine's own buffers.
#[derive(Debug, Clone)]
pub struct ShardState<V = TensorData> {
    /// This rank's ranges, in its shard's order.
    pub ranges: Vec<ParamRange>,
    /// Their fp32 weights: the master weights under mixed precision.
    pub weights: Vec<V>,
    /// Their first and second AdamW moments, fp32, once a step has made them.
    pub moments: Option<[Vec<V>; 2]>,
    /// Optimizer steps taken.
    pub steps: usize,
    /// The loss scaler's state (f16).
    pub loss_scale: Option<LossScaleState>,
}

/// The values of one range of a ZeRO engine's state, fp32, where the engine holds them: on its
/// device, or in host memory where its optimizer is offloaded.
#[derive(Debug, Clone)]
pub enum StateTensor<B: Backend> {
    Device(Tensor<B, 1>),
    Host(Tensor<Flex, 1>),
}

impl<B: Backend> StateTensor<B> {
    /// The `len` values from `start`: a view, not a copy.
    pub fn narrow(self, start: usize, len: usize) -> Self {
        match self {
            Self::Device(t) => Self::Device(t.narrow(0, start, len)),
            Self::Host(t) => Self::Host(t.narrow(0, start, len)),
        }
    }

    /// As many zeros (fp32), in host memory: moments a checkpoint writes before any step made
    /// them, which need no room on a device.
    pub fn host_zeros_like(&self) -> Self {
        let len = match self {
            Self::Device(t) => t.dims()[0],
            Self::Host(t) => t.dims()[0],
        };
        Self::Host(Tensor::zeros([len], (&Default::default(), DType::F32)))
    }

    /// The values in host memory.
    pub fn into_data(self) -> TensorData {
        match self {
            Self::Device(t) => t.into_data(),
            Self::Host(t) => t.into_data(),
        }
    }
}

impl<B: Backend> ShardState<StateTensor<B>> {
    /// The same state read into host memory.
    pub fn into_host(self) -> ShardState {
        let host =
            |values: Vec<StateTensor<B>>| values.into_iter().map(StateTensor::into_data).collect();
        ShardState {
            ranges: self.ranges,
            weights: host(self.weights),
            moments: self.moments.map(|moments| moments.map(host)),
            steps: self.steps,
            loss_scale: self.loss_scale,
        }
    }
}

/// Dynamic loss scaling's running state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    /// The scale the next backward multiplies by.
    pub scale: f64,
    /// Applied steps since the scale last changed.
    pub good_steps: usize,
}

/// `rank`'s ranges of the parameters of `layout` (named `names`, shaped `shapes`), in its
/// shard's order.
pub(crate) fn ranges(
    layout: &FlatLayout,
    names: &[String],
    shapes: &[Vec<usize>],
    rank: usize,
) -> Vec<ParamRange> {
    (0..layout.units.len())
        .flat_map(|u| layout.pieces(u, rank))
        .map(|(p, range, _)| ParamRange {
            name: names[p].clone(),
            shape: shapes[p].clone(),
            range,
        })
        .collect()
}

/// `parts` (`rank`'s part of every unit, in order) cut into its ranges' values, in order: views
/// of `parts`, not copies.
pub(crate) fn cut<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    parts: Vec<StateTensor<B>>,
) -> Vec<StateTensor<B>> {
    parts
        .into_iter()
        .enumerate()
        .flat_map(|(u, part)| {
            layout
                .pieces(u, rank)
                .into_iter()
                .map(move |(_, range, at)| part.clone().narrow(at, range.len()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `rank`'s part of every unit from its ranges' `values` (in order), zeros in the padding.
pub(crate) fn join<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    values: &[TensorData],
    device: &B::Device,
) -> Result<Vec<Tensor<B, 1>>, ZeroError> {
    let mut values = values.iter();
    let mut parts = Vec::with_capacity(layout.units.len());
    for u in 0..layout.units.len() {
        let mut part = vec![0f32; layout.shard_len(u)];
        for (p, range, at) in layout.pieces(u, rank) {
            let value = values.next().ok_or_else(|| {
                ZeroError::Config(format!(
                    "fewer values than this rank's ranges, none for parameter {p}"
                ))
            })?;
            let value = value
                .clone()
                .convert::<f32>()
                .to_vec::<f32>()
                .map_err(|e| ZeroError::Config(format!("parameter {p}'s values: {e:?}")))?;
            if value.len() != range.len() {
                return Err(ZeroError::Config(format!(
                    "{} values for parameter {p}'s {} elements {range:?}",
                    value.len(),
                    range.len()
                )));
            }
            part[at..at + range.len()].copy_from_slice(&value);
        }
        let n = part.len();
        parts.push(Tensor::from_data(TensorData::new(part, [n]), device));
    }
    if values.next().is_some() {
        return Err(ZeroError::Config(
            "more values than this rank's ranges".into(),
        ));
    }
    Ok(parts)
}

/// `rank`'s ranges' values cut from the parameters' `values` (flat, by parameter index), each
/// copied to host memory: a view would keep the whole buffer the parameter was gathered into
/// alive, and a copy on the device would take device memory until the save is written.
pub(crate) fn cut_params<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    values: &[Tensor<B, 1>],
) -> Vec<StateTensor<B>> {
    (0..layout.units.len())
        .flat_map(|u| layout.pieces(u, rank))
        .map(|(p, range, _)| {
            let range = values[p].clone().narrow(0, range.start, range.len());
            StateTensor::Host(to_host(range))
        })
        .collect()
}

/// `rank`'s state: `ranges` (see [`ranges`]), their fp32 `weights` (in order), and the
/// optimizer's (where it holds it) and the loss scaler's state.
pub(crate) fn shard_state<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    ranges: Vec<ParamRange>,
    weights: Vec<StateTensor<B>>,
    optimizer: &PlacedAdamW<B>,
    scaler: Option<&LossScaler>,
) -> ShardState<StateTensor<B>> {
    let (moments, steps) = moments_of(layout, rank, optimizer);
    ShardState {
        ranges,
        weights,
        moments,
        steps,
        loss_scale: scaler.map(LossScaler::state),
    }
}

/// Puts a state's moments, step count (in `rank`'s ranges' order) and loss scale back.
#[allow(clippy::too_many_arguments)]
pub(crate) fn restore<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    optimizer: &mut PlacedAdamW<B>,
    scaler: Option<&mut LossScaler>,
    moments: Option<&[Vec<TensorData>; 2]>,
    steps: usize,
    loss_scale: Option<LossScaleState>,
    device: &B::Device,
) -> Result<(), ZeroError> {
    restore_moments(layout, rank, optimizer, moments, steps, device)?;
    restore_scaler(scaler, loss_scale)
}

/// The moments and step count of `optimizer` as a state's, cut into ranges.
fn moments_of<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    optimizer: &PlacedAdamW<B>,
) -> (Option<[Vec<StateTensor<B>>; 2]>, usize) {
    match optimizer.held_state() {
        Some((time, [first, second])) => {
            let moments = [cut(layout, rank, first), cut(layout, rank, second)];
            (Some(moments), time)
        }
        None => (None, 0),
    }
}

/// `scaler` continuing from a state's.
fn restore_scaler(
    scaler: Option<&mut LossScaler>,
    state: Option<LossScaleState>,
) -> Result<(), ZeroError> {
    match (scaler, state) {
        (Some(scaler), Some(state)) => scaler.restore(state),
        (None, None) => {}
        (Some(_), None) => {
            return Err(ZeroError::Config(
                "this engine scales the loss (f16), but the state was saved without loss scaling; resume with the dtype it was saved in".into(),
            ));
        }
        (None, Some(_)) => {
            return Err(ZeroError::Config(
                "the state was saved with f16 loss scaling, which this engine does not do; resume with the dtype it was saved in".into(),
            ));
        }
    }
    Ok(())
}

/// `optimizer` with the moments and step count of a state (in `rank`'s ranges' order).
fn restore_moments<B: Backend>(
    layout: &FlatLayout,
    rank: usize,
    optimizer: &mut PlacedAdamW<B>,
    moments: Option<&[Vec<TensorData>; 2]>,
    steps: usize,
    device: &B::Device,
) -> Result<(), ZeroError> {
    let state = match moments {
        None if steps == 0 => None,
        None => {
            return Err(ZeroError::Config(format!(
                "the state says {steps} steps were taken but holds no moments"
            )));
        }
        Some([first, second]) => Some((
            steps,
            [
                join(layout, rank, first, device)?,
                join(layout, rank, second, device)?,
            ],
        )),
    };
    optimizer.set_state(state);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_moments_for_a_save_are_made_in_host_memory() {
        let on_device = StateTensor::<Flex>::Device(Tensor::ones([5], &Default::default()));
        match on_device.host_zeros_like() {
            StateTensor::Host(zeros) => {
                assert_eq!(zeros.into_data(), TensorData::from([0.0f32; 5]));
            }
            StateTensor::Device(_) => panic!("the zeros took room on the device"),
        }
    }
}
