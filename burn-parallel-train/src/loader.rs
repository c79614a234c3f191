//! burn's `DataLoader` over burn-ddp's `DistributedSampler`: every rank reads its own disjoint
//! share of each epoch, the same number of batches on every rank.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::Dataset;
use burn::data::dataset::transform::PartialDataset;
use burn::tensor::backend::Backend;
use burn_comm::Communicator;
use burn_ddp::{DdpError, DistributedSampler};

/// A data loader that gives this rank batches of `batch_size` of its share of the dataset.
///
/// Rank `r` of `w` reads positions `r, r + w, ...` of each epoch's order, so the first batch of
/// every rank together is the first `w * batch_size` samples: the batch one device reads with
/// a global batch of `w * batch_size`. Each call of `iter` is the next epoch, reshuffled from
/// `(seed, epoch)` when shuffling is on, so ranks agree without talking. A dataset that does
/// not divide by the ranks is padded with its first samples (PyTorch's default), or its tail
/// dropped with [`Self::with_drop_last`], so every rank reads as many batches as the others.
pub struct DistributedDataLoader<B: Backend, I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    sampler: DistributedSampler,
    batch_size: usize,
    device: B::Device,
    epoch: AtomicU64,
}

impl<B: Backend, I, O> DistributedDataLoader<B, I, O> {
    /// This rank's loader over `dataset`: `batch_size` is per rank, `comm` the data-parallel
    /// group. Unshuffled until [`Self::with_shuffle`].
    pub fn new<D, Bt>(
        batcher: Bt,
        dataset: D,
        batch_size: usize,
        comm: &Communicator,
    ) -> Result<Self, DdpError>
    where
        D: Dataset<I> + 'static,
        Bt: Batcher<B, I, O> + 'static,
    {
        Self::for_rank(batcher, dataset, batch_size, comm.rank(), comm.size())
    }

    /// As [`Self::new`], for rank `rank` of `world` given as numbers.
    pub fn for_rank<D, Bt>(
        batcher: Bt,
        dataset: D,
        batch_size: usize,
        rank: usize,
        world: usize,
    ) -> Result<Self, DdpError>
    where
        D: Dataset<I> + 'static,
        Bt: Batcher<B, I, O> + 'static,
    {
        if batch_size == 0 {
            return Err(DdpError::Config(
                "the batch size is 0; give each rank at least one sample per batch".into(),
            ));
        }
        let sampler = DistributedSampler::new(dataset.len(), world, rank)?.with_shuffle(false);
        Ok(Self {
            dataset: Arc::new(dataset),
            batcher: Arc::new(batcher),
            sampler,
            batch_size,
            device: Default::default(),
            epoch: AtomicU64::new(0),
        })
    }

    /// Reshuffle every epoch from `seed`, the same on every rank.
    pub fn with_shuffle(mut self, seed: u64) -> Self {
        self.sampler = self.sampler.with_shuffle(true).with_seed(seed);
        self
    }

    /// Drop the samples that do not fill a round of every rank instead of repeating the first.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.sampler = self.sampler.with_drop_last(drop_last);
        self
    }

    /// The device batches are made on (default: the backend's default device).
    pub fn with_device(mut self, device: B::Device) -> Self {
        self.device = device;
        self
    }

    /// Into the `Arc` that `SupervisedTraining::new` takes.
    pub fn into_arc(self) -> Arc<dyn DataLoader<B, O>>
    where
        I: Send + Sync + Clone + 'static,
        O: Send + 'static,
    {
        Arc::new(self)
    }

    fn with_parts(&self, dataset: Arc<dyn Dataset<I>>, sampler: DistributedSampler) -> Self {
        Self {
            dataset,
            batcher: self.batcher.clone(),
            sampler,
            batch_size: self.batch_size,
            device: self.device.clone(),
            epoch: AtomicU64::new(self.epoch.load(Ordering::Relaxed)),
        }
    }
}

impl<B, I, O> DataLoader<B, O> for DistributedDataLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed);
        Box::new(Batches {
            loader: self,
            indices: self.sampler.indices(epoch),
            next: 0,
        })
    }

    /// Samples this rank reads per epoch.
    fn num_items(&self) -> usize {
        self.sampler.num_samples()
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        let mut loader = self.with_parts(self.dataset.clone(), self.sampler.clone());
        loader.device = device.clone();
        Arc::new(loader)
    }

    /// The same ranks over samples `start..end` of the dataset.
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let end = end.min(self.dataset.len());
        let start = start.min(end);
        let dataset: Arc<dyn Dataset<I>> =
            Arc::new(PartialDataset::new(self.dataset.clone(), start, end));
        let sampler = self.sampler.resized(end - start).unwrap_or_else(|e| {
            panic!("cannot slice the distributed loader to samples {start}..{end}: {e}")
        });
        Arc::new(self.with_parts(dataset, sampler))
    }
}

struct Batches<'a, B: Backend, I, O> {
    loader: &'a DistributedDataLoader<B, I, O>,
    indices: Vec<usize>,
    next: usize,
}

impl<B: Backend, I, O> Iterator for Batches<'_, B, I, O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        let end = (self.next + self.loader.batch_size).min(self.indices.len());
        if self.next >= end {
            return None;
        }
        let items = self.indices[self.next..end]
            .iter()
            .map(|&i| {
                self.loader.dataset.get(i).unwrap_or_else(|| {
                    panic!(
                        "the dataset has no sample {i} though it said it had {}",
                        self.loader.dataset.len()
                    )
                })
            })
            .collect();
        self.next = end;
        Some(self.loader.batcher.batch(items, &self.loader.device))
    }
}

impl<B: Backend, I, O> DataLoaderIterator<O> for Batches<'_, B, I, O> {
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.indices.len())
    }
}
