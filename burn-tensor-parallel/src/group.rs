//! The tensor-parallel group and the two places where activations cross it: entering a
//! column-parallel region and leaving a row-parallel one.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_comm::Communicator;
use burn_comm::parallel::{CommBackend, RegionOp, copy_to_parallel_region, matmul, region_matmul};

use crate::TpError;

/// The sequence dimension of activations shaped `[batch, seq, hidden]`, along which sequence
/// parallelism splits them.
pub const SEQ_DIM: usize = 1;

/// A tensor-parallel group, and whether activations outside the parallel regions are split
/// along the sequence (Megatron's sequence parallelism) or held in full by every rank.
#[derive(Debug, Clone)]
pub struct TensorParallel {
    comm: Communicator,
    sequence_parallel: bool,
    /// Chunks of the collective matmuls, or 0 for the region op and the matmul one after the
    /// other.
    overlap_chunks: usize,
    /// The groups of ranks that share a block, by block count (see
    /// [`TensorParallel::replica_group`]), shared by the clones.
    replicas: Arc<Mutex<HashMap<usize, Communicator>>>,
}

impl TensorParallel {
    /// Plain tensor parallelism over `comm`: activations between the parallel regions are
    /// replicated on every rank.
    pub fn new(comm: Communicator) -> Self {
        Self {
            comm,
            sequence_parallel: false,
            overlap_chunks: 0,
            replicas: Arc::default(),
        }
    }

    /// With `enabled`, activations between the parallel regions are split along [`SEQ_DIM`].
    pub fn with_sequence_parallel(mut self, enabled: bool) -> Self {
        self.sequence_parallel = enabled;
        self
    }

    /// With `chunks` > 0, the communication at the edges of the parallel regions is fused with
    /// the matmul beside it and cut into `chunks`, so it overlaps the multiplication
    /// ([`region_matmul`]; Megatron's `tp_comm_overlap`). 0, the default, runs them one after
    /// the other.
    pub fn with_comm_overlap(mut self, chunks: usize) -> Self {
        self.overlap_chunks = chunks;
        self
    }

    /// The chunks of the collective matmuls; 0 when communication does not overlap.
    pub fn comm_overlap(&self) -> usize {
        self.overlap_chunks
    }

    /// The group.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Whether sequence parallelism is on.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// Fails unless `value` (called `what`) splits evenly over the group.
    pub fn check_divides(&self, what: &str, value: usize) -> Result<(), TpError> {
        let tp = self.size();
        if value.is_multiple_of(tp) {
            return Ok(());
        }
        Err(TpError::Config(format!(
            "{what} ({value}) does not divide by the tensor-parallel size {tp}; choose a tensor-parallel size among {} or change {what} to a multiple of {tp}",
            divisors(value)
        )))
    }

    /// When something is cut into `blocks` (fewer than the ranks) and each block is held by
    /// `size / blocks` neighbouring ranks: the group of the ranks that hold this rank's block.
    /// Made once per block count (a collective the first time: every rank asks for the same
    /// counts in the same order, as building the same model does).
    pub fn replica_group(&self, blocks: usize) -> Result<Communicator, TpError> {
        let mut groups = self.replicas.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(group) = groups.get(&blocks) {
            return Ok(group.clone());
        }
        let block = self.rank() / (self.size() / blocks);
        let name = format!("{}/replicas-of-{blocks}[{block}]", self.comm.group_name());
        let group = self.comm.split(&name, block)?;
        groups.insert(blocks, group.clone());
        Ok(group)
    }

    /// This rank's block of `full` cut into `blocks` equal blocks along `dim` (`blocks` divides
    /// the group; each block is held by `size / blocks` neighbouring ranks), as a tensor of its
    /// own: a slice would be a view keeping the whole alive, and, of a tracked parameter, no
    /// leaf.
    pub fn block_of<B: Backend, const D: usize>(
        &self,
        full: Tensor<B, D>,
        dim: usize,
        blocks: usize,
    ) -> Result<Tensor<B, D>, TpError> {
        let range = self.block_range(full.dims()[dim], blocks)?;
        let part = full.narrow(dim, range.start, range.len());
        // A copy of its own (a view would keep the whole alive), in the whole's dtype.
        let (device, dtype) = (part.device(), part.dtype());
        Ok(Tensor::from_data(part.into_data(), (&device, dtype)))
    }

    /// Where [`block_of`](Self::block_of) cuts a dimension of `len` elements into `blocks`:
    /// this rank's block's elements (to read only them, as a checkpoint loader does).
    pub fn block_range(&self, len: usize, blocks: usize) -> Result<Range<usize>, TpError> {
        self.check_blocks(len, blocks)?;
        let width = len / blocks;
        let block = self.rank() / (self.size() / blocks);
        Ok(block * width..(block + 1) * width)
    }

    /// The whole of what [`block_of`](Self::block_of) cut: every rank's block all-gathered
    /// along `dim`, one copy of each (a collective).
    pub fn gather_blocks<B: Backend, const D: usize>(
        &self,
        part: Tensor<B, D>,
        dim: usize,
        blocks: usize,
    ) -> Result<Tensor<B, D>, TpError> {
        self.check_blocks(part.dims()[dim] * blocks, blocks)?;
        let all = self.comm.all_gather(part, dim)?;
        let replication = self.size() / blocks;
        if replication == 1 {
            return Ok(all);
        }
        let width = all.dims()[dim] / self.size();
        let kept = (0..self.size())
            .step_by(replication)
            .map(|rank| all.clone().narrow(dim, rank * width, width))
            .collect();
        Ok(Tensor::cat(kept, dim))
    }

    /// Fails unless `len` cuts into `blocks` equal blocks, each held by the same number of
    /// ranks.
    fn check_blocks(&self, len: usize, blocks: usize) -> Result<(), TpError> {
        let size = self.size();
        if blocks == 0 || !size.is_multiple_of(blocks) || !len.is_multiple_of(blocks) {
            return Err(TpError::Config(format!(
                "{len} elements in {blocks} blocks cannot be shared by a tensor-parallel group of {size}; the block count must divide both"
            )));
        }
        Ok(())
    }

    /// This rank's part of a dimension of `len` split evenly over the group.
    pub fn part(&self, len: usize) -> Range<usize> {
        let part = len / self.size();
        self.rank() * part..(self.rank() + 1) * part
    }

    /// The operation that enters a column-parallel region: copy (the gradient is all-reduced
    /// on the way back), or under SP an all-gather of the sequence (the gradient is
    /// reduce-scattered).
    pub fn enter_op(&self) -> RegionOp {
        match self.sequence_parallel {
            true => RegionOp::SequenceGather { dim: SEQ_DIM },
            false => RegionOp::Copy,
        }
    }

    /// The operation that leaves a row-parallel region by summing the ranks' partial results:
    /// all-reduce, or under SP reduce-scatter along the sequence, so each rank keeps its part.
    pub fn exit_op(&self) -> RegionOp {
        match self.sequence_parallel {
            true => RegionOp::SequenceReduceScatter { dim: SEQ_DIM },
            false => RegionOp::Reduce,
        }
    }

    /// Enters a column-parallel region ([`enter_op`](Self::enter_op)): the activations every
    /// rank needs in full.
    pub fn enter<B: CommBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TpError> {
        Ok(B::region_op(x, &self.comm, self.enter_op())?)
    }

    /// Leaves a row-parallel region ([`exit_op`](Self::exit_op)).
    pub fn exit<B: CommBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TpError> {
        self.check_exit(&x.dims())?;
        Ok(B::region_op(x, &self.comm, self.exit_op())?)
    }

    /// `enter(x) @ w` for a `[in, out]` weight: fused and chunked when communication overlaps.
    pub fn enter_matmul<B: CommBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        w: Tensor<B, 2>,
    ) -> Result<Tensor<B, D>, TpError> {
        match self.overlap_chunks {
            0 => Ok(matmul(self.enter(x)?, w)),
            chunks => Ok(region_matmul(x, w, &self.comm, self.enter_op(), chunks)?),
        }
    }

    /// `enter(x) @ w` for several `[in, out]` weights that share one input (attention's q, k
    /// and v, the MLP's gate and up): the input enters the region once. When communication
    /// overlaps, the weights are joined so that one collective matmul serves them all.
    pub fn enter_matmul_many<B: CommBackend, const D: usize, const N: usize>(
        &self,
        x: Tensor<B, D>,
        weights: [Tensor<B, 2>; N],
    ) -> Result<[Tensor<B, D>; N], TpError> {
        if self.overlap_chunks == 0 {
            let x = self.enter(x)?;
            return Ok(weights.map(|w| matmul(x.clone(), w)));
        }
        let widths = weights.each_ref().map(|w| w.dims()[1]);
        let y = self.enter_matmul(x, Tensor::cat(weights.to_vec(), 1))?;
        let mut start = 0;
        Ok(widths.map(|width| {
            let part = y.clone().narrow(D - 1, start, width);
            start += width;
            part
        }))
    }

    /// `exit(x @ w)` for a `[in, out]` weight: fused and chunked when communication overlaps.
    pub fn matmul_exit<B: CommBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        w: Tensor<B, 2>,
    ) -> Result<Tensor<B, D>, TpError> {
        match self.overlap_chunks {
            0 => self.exit(matmul(x, w)),
            chunks => {
                self.check_exit(&x.dims())?;
                Ok(region_matmul(x, w, &self.comm, self.exit_op(), chunks)?)
            }
        }
    }

    /// Under SP, what leaves a region is split along the sequence, which must divide.
    fn check_exit<const D: usize>(&self, dims: &[usize; D]) -> Result<(), TpError> {
        match self.sequence_parallel {
            true => self.check_divides("the sequence length", dims[SEQ_DIM]),
            false => Ok(()),
        }
    }

    /// A weight every rank holds in full (a norm's scale, a row-parallel bias), as the
    /// computation should see it. Under SP each rank applies it to its own part of the
    /// sequence only, so its gradient is summed over the group on the way back; under plain TP
    /// every rank already computes the whole gradient.
    pub fn replicated<B: CommBackend, const D: usize>(
        &self,
        weight: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TpError> {
        Ok(if self.sequence_parallel {
            copy_to_parallel_region(weight, &self.comm)?
        } else {
            weight
        })
    }
}

/// The divisors of `n` up to 64, for messages that suggest a tensor-parallel size.
pub fn divisors(n: usize) -> String {
    let list: Vec<String> = (1..=n.min(64))
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    list.join(", ")
}
