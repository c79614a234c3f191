//! The samples each rank reads at each step: its share of every global batch, cut the same
//! way in every layout so that all of them see the same data as one device.

use std::cell::RefCell;
use std::rc::Rc;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_ddp::{DdpError, DistributedSampler};

use crate::data::Dataset;
use crate::train::{Layout, TrainConfig, TrainError};

/// The samples of every step for one rank, from the sampler.
pub(crate) struct Batches<'a> {
    data: &'a dyn Dataset,
    /// This rank's share of every global batch.
    rank: Reading,
    /// Whole global batches, in the single-device order (for the parameter server's rank 0).
    single: Reading,
    micro: usize,
    accum: usize,
    seq_len: usize,
}

/// A sampler read `per_step` samples at a time, with its current epoch's order kept: a
/// permutation of the whole dataset is too costly to rebuild for every micro-batch.
struct Reading {
    sampler: DistributedSampler,
    per_step: usize,
    epoch: RefCell<Option<(usize, Rc<Vec<usize>>)>>,
}

impl Reading {
    fn new(sampler: DistributedSampler, per_step: usize) -> Self {
        Self {
            sampler,
            per_step,
            epoch: RefCell::new(None),
        }
    }

    /// The reading order of `step`'s epoch, and where `step` starts in it.
    fn step(&self, step: usize) -> (Rc<Vec<usize>>, usize) {
        let steps_per_epoch = self.sampler.num_samples() / self.per_step;
        let (epoch, position) = (step / steps_per_epoch, step % steps_per_epoch);
        let cached = self.epoch.borrow().clone().filter(|(e, _)| *e == epoch);
        let order = match cached {
            Some((_, order)) => order,
            None => {
                let order = Rc::new(self.sampler.indices(epoch as u64));
                *self.epoch.borrow_mut() = Some((epoch, order.clone()));
                order
            }
        };
        (order, position * self.per_step)
    }
}

impl<'a> Batches<'a> {
    pub(crate) fn new(
        config: &TrainConfig,
        data: &'a dyn Dataset,
        world: usize,
        rank: usize,
        layout: Layout,
    ) -> Result<Self, TrainError> {
        // Without padding, every layout cuts the epoch's permutation into the same global batches.
        let sampler = |world, rank| -> Result<DistributedSampler, DdpError> {
            Ok(DistributedSampler::new(data.len(), world, rank)?
                .with_seed(config.seed)
                .with_drop_last(true))
        };
        let (rank, single) = (sampler(world, rank)?, sampler(1, 0)?);
        if data.len() < config.batch_size {
            return Err(TrainError::Config(format!(
                "the dataset has {} samples, fewer than one global batch of {}; use more data or a smaller --batch-size",
                data.len(),
                config.batch_size
            )));
        }
        Ok(Self {
            data,
            rank: Reading::new(rank, layout.per_rank),
            single: Reading::new(single, config.batch_size),
            micro: layout.micro,
            accum: layout.accum,
            seq_len: config.seq_len,
        })
    }

    /// Samples `[start, start + count)` of `reading`'s samples for `step`, as tokens.
    fn read<B: Backend>(
        &self,
        reading: &Reading,
        step: usize,
        start: usize,
        count: usize,
        device: &B::Device,
    ) -> Tensor<B, 2, Int> {
        let (order, first) = reading.step(step);
        let first = first + start;
        let tokens: Vec<i64> = order[first..first + count]
            .iter()
            .flat_map(|&i| self.data.sample(i))
            .map(|t| t as i64)
            .collect();
        Tensor::from_data(TensorData::new(tokens, [count, self.seq_len + 1]), device)
    }

    /// Inputs and targets of this rank's micro-batch `micro` of `step`.
    pub(crate) fn micro<B: Backend>(
        &self,
        step: usize,
        micro: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let m = self.micro;
        let tokens = self.read(&self.rank, step, micro * m, m, device);
        (
            tokens.clone().narrow(1, 0, self.seq_len),
            tokens.narrow(1, 1, self.seq_len),
        )
    }

    /// Micro-batches per step on this rank.
    pub(crate) fn micro_batches(&self) -> usize {
        self.accum
    }

    /// Samples per micro-batch.
    pub(crate) fn micro_batch_size(&self) -> usize {
        self.micro
    }

    /// The whole global batch of `step`, in the single-device order (for the parameter server).
    pub(crate) fn global<B: Backend>(&self, step: usize, device: &B::Device) -> Tensor<B, 2, Int> {
        self.read(&self.single, step, 0, self.single.per_step, device)
    }
}
