//! Which samples each rank reads: `torch.utils.data.DistributedSampler`.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::DdpError;

/// Splits a dataset of `len` samples into one disjoint shard per rank, reshuffled every epoch
/// from `(seed, epoch)` so that every rank agrees on the permutation without talking.
///
/// Rank `r` reads positions `r, r + world, r + 2 world, ...` of the epoch's permutation, so the
/// first `b` samples of every rank together are the first `b * world` samples of the
/// permutation: the same global batch one device would read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
}

impl DistributedSampler {
    /// A shuffling sampler with seed 0 that pads the last round by repeating samples.
    pub fn new(len: usize, world: usize, rank: usize) -> Result<Self, DdpError> {
        if world == 0 || rank >= world {
            return Err(DdpError::Config(format!(
                "rank {rank} is not in a world of {world}; the rank must be below the world size"
            )));
        }
        if len == 0 {
            return Err(DdpError::Config(
                "the dataset is empty; a sampler needs at least one sample".into(),
            ));
        }
        Ok(Self {
            len,
            world,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
        })
    }

    /// Whether to shuffle every epoch (default true).
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed shared by every rank (default 0).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the tail that does not fill a round for every rank, instead of padding it with
    /// samples from the start (default false).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The same sampler (rank, shuffle, seed, tail) over a dataset of `len` samples.
    pub fn resized(&self, len: usize) -> Result<Self, DdpError> {
        Ok(Self {
            len,
            ..Self::new(len, self.world, self.rank)?
        }
        .with_shuffle(self.shuffle)
        .with_seed(self.seed)
        .with_drop_last(self.drop_last))
    }

    /// Samples this rank reads per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world
        } else {
            self.len.div_ceil(self.world)
        }
    }

    /// This rank's sample indices for `epoch`, in reading order.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = StdRng::seed_from_u64(self.seed.wrapping_add(epoch));
            order.shuffle(&mut rng);
        }
        let total = self.num_samples() * self.world;
        let mut padded = order.clone();
        while padded.len() < total {
            let missing = total - padded.len();
            padded.extend_from_slice(&order[..missing.min(order.len())]);
        }
        padded.truncate(total);
        padded
            .into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .collect()
    }
}

/// The per-rank batch for a `global` batch over `world` ranks, or an error saying what to change.
pub fn per_rank_batch(global: usize, world: usize) -> Result<usize, DdpError> {
    if world == 0 || global == 0 || !global.is_multiple_of(world) {
        return Err(DdpError::BatchNotDivisible { global, world });
    }
    Ok(global / world)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_cover_the_epoch() {
        for (len, world) in [(10, 3), (12, 4), (7, 1), (5, 8)] {
            let shards: Vec<Vec<usize>> = (0..world)
                .map(|r| DistributedSampler::new(len, world, r).unwrap().indices(2))
                .collect();
            let mut all: Vec<usize> = shards.concat();
            assert_eq!(all.len(), len.div_ceil(world) * world);
            all.sort();
            all.dedup();
            assert_eq!(all, (0..len).collect::<Vec<_>>());
            let dropped: usize = (0..world)
                .map(|r| {
                    let s = DistributedSampler::new(len, world, r).unwrap();
                    s.with_drop_last(true).indices(2).len()
                })
                .sum();
            assert_eq!(dropped, len / world * world);
        }
    }

    #[test]
    fn ranks_together_read_the_single_device_batches() {
        let single = DistributedSampler::new(64, 1, 0)
            .unwrap()
            .with_seed(9)
            .indices(3);
        let ranks: Vec<Vec<usize>> = (0..4)
            .map(|r| {
                DistributedSampler::new(64, 4, r)
                    .unwrap()
                    .with_seed(9)
                    .indices(3)
            })
            .collect();
        let (global, local) = (8, 2);
        for step in 0..8 {
            let mut want = single[step * global..(step + 1) * global].to_vec();
            let mut got: Vec<usize> = ranks
                .iter()
                .flat_map(|r| r[step * local..(step + 1) * local].to_vec())
                .collect();
            want.sort();
            got.sort();
            assert_eq!(want, got);
        }
    }

    #[test]
    fn epochs_reshuffle_and_bad_input_is_refused() {
        let s = DistributedSampler::new(100, 2, 1).unwrap();
        assert_ne!(s.indices(0), s.indices(1));
        assert_eq!(s.indices(1), s.indices(1));
        assert!(DistributedSampler::new(10, 2, 2).is_err());
        assert!(DistributedSampler::new(0, 2, 0).is_err());
        assert_eq!(per_rank_batch(8, 4).unwrap(), 2);
        let err = per_rank_batch(6, 4).unwrap_err().to_string();
        assert!(err.contains("multiple of 4"), "{err}");
    }
}
