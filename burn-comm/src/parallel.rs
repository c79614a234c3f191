//! Autodiff-aware communication for tensor and sequence parallelism, under Megatron-LM's
//! names. Each operation is a pair: what it does forward and what its backward does to the
//! gradient, which is always the forward of its adjoint ([`RegionOp::adjoint`]).
//!
//! | operation | forward | backward |
//! |---|---|---|
//! | [`copy_to_parallel_region`] | identity | all-reduce (sum) |
//! | [`reduce_from_parallel_region`] | all-reduce (sum) | identity |
//! | [`scatter_to_parallel_region`] | keep own part along `dim` | all-gather |
//! | [`gather_from_parallel_region`] | all-gather along `dim` | keep own part |
//! | [`gather_from_sequence_parallel_region`] | all-gather along `dim` | reduce-scatter (sum) |
//! | [`reduce_scatter_to_sequence_parallel_region`] | reduce-scatter (sum) along `dim` | all-gather |
//!
//! [`ring_attention`] is attention over a sequence split across the group (context
//! parallelism), differentiated by hand: its backward passes the keys and values around again.
//!
//! [`region_matmul`] fuses `Copy`, `Reduce` and the two sequence ops with the matmul beside
//! them, cut into chunks so the communication overlaps the multiplication.
//!
//! On a backend without autodiff only the forward runs. In the backward pass a failed
//! collective cannot return an error (burn's backward returns nothing), so it panics with the
//! error's message; under [`crate::launch`] that becomes [`CommError::PeerFailed`] on the peers.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use burn::backend::{Flex, NdArray};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

pub use crate::all_to_all_split::SplitSizes;
pub use crate::collective_matmul::matmul;
pub use crate::ring_attention::{ContextLayout, RingAttention, ring_attention};
use crate::{
    CommError, Communicator, ReduceOp, all_to_all_split, collective_matmul, ring_attention,
};

/// One of the six region operations, by what its forward does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionOp {
    /// Identity forward, all-reduce backward (Megatron's `f`).
    Copy,
    /// All-reduce forward, identity backward (Megatron's `g`).
    Reduce,
    /// Keep this rank's part along `dim`.
    Scatter {
        /// The split dimension.
        dim: usize,
    },
    /// All-gather along `dim`, backward keeps this rank's part.
    Gather {
        /// The concatenation dimension.
        dim: usize,
    },
    /// All-gather along `dim`, backward reduce-scatters (sequence parallelism).
    SequenceGather {
        /// The sequence dimension.
        dim: usize,
    },
    /// Reduce-scatter along `dim`, backward all-gathers (sequence parallelism).
    SequenceReduceScatter {
        /// The sequence dimension.
        dim: usize,
    },
}

impl RegionOp {
    /// The operation whose forward is this one's backward.
    pub fn adjoint(self) -> Self {
        match self {
            RegionOp::Copy => RegionOp::Reduce,
            RegionOp::Reduce => RegionOp::Copy,
            RegionOp::Scatter { dim } => RegionOp::Gather { dim },
            RegionOp::Gather { dim } => RegionOp::Scatter { dim },
            RegionOp::SequenceGather { dim } => RegionOp::SequenceReduceScatter { dim },
            RegionOp::SequenceReduceScatter { dim } => RegionOp::SequenceGather { dim },
        }
    }

    /// Runs the forward of this operation on any backend, without recording a graph.
    pub fn forward<B: Backend, const D: usize>(
        self,
        x: Tensor<B, D>,
        comm: &Communicator,
    ) -> Result<Tensor<B, D>, CommError> {
        match self {
            RegionOp::Copy => Ok(x),
            RegionOp::Reduce => comm.all_reduce(x, ReduceOp::Sum),
            RegionOp::Scatter { dim } => own_part(x, comm, dim),
            RegionOp::Gather { dim } | RegionOp::SequenceGather { dim } => comm.all_gather(x, dim),
            RegionOp::SequenceReduceScatter { dim } => comm.reduce_scatter(x, ReduceOp::Sum, dim),
        }
    }
}

/// This rank's part of `x` along `dim`, when `x` splits into equal parts over the group.
fn own_part<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    let invalid = |reason: String| CommError::InvalidArgument {
        op: format!("scatter_to_parallel_region(dim {dim})"),
        group: comm.group_name().to_string(),
        reason,
    };
    if dim >= D {
        return Err(invalid(format!(
            "dim {dim} is out of range for a {D}-d tensor"
        )));
    }
    let len = x.dims()[dim];
    if !len.is_multiple_of(comm.size()) {
        return Err(invalid(format!(
            "size {len} along dim {dim} does not divide by the group size {}",
            comm.size()
        )));
    }
    let part = len / comm.size();
    Ok(x.narrow(dim, comm.rank() * part, part))
}

/// A backend on which the region operations can run: every backend forwards them; on
/// [`Autodiff`] they also record their backward. Implemented for `Flex`, `NdArray`, the cubecl
/// GPU backends (feature `cuda`) and `Autodiff` over any backend.
pub trait CommBackend: Backend {
    /// Applies `op`, recording its backward where the backend differentiates.
    fn region_op<const D: usize>(
        x: Tensor<Self, D>,
        comm: &Communicator,
        op: RegionOp,
    ) -> Result<Tensor<Self, D>, CommError> {
        op.forward(x, comm)
    }

    /// `op` fused with the matmul `x @ w` (`w` is `[in, out]`), cut into `chunks` so the
    /// collective of one chunk overlaps the matmul of the next: `enter(x) @ w` for `Copy` and
    /// `SequenceGather`, `exit(x @ w)` for `Reduce` and `SequenceReduceScatter`. See
    /// [`region_matmul`].
    fn region_matmul<const D: usize>(
        x: Tensor<Self, D>,
        w: Tensor<Self, 2>,
        comm: &Communicator,
        op: RegionOp,
        chunks: usize,
    ) -> Result<Tensor<Self, D>, CommError> {
        collective_matmul::forward(x, w, comm, op, chunks)
    }

    /// Attention over a sequence split across the group, keys and values passed around the
    /// ring. See [`ring_attention`].
    fn ring_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        comm: &Communicator,
        attention: RingAttention,
    ) -> Result<Tensor<Self, 4>, CommError> {
        ring_attention::forward_only(q, k, v, comm, attention)
    }

    /// All-to-all with parts of any size along `dim`; see [`all_to_all_split`].
    fn all_to_all_split<const D: usize>(
        x: Tensor<Self, D>,
        dim: usize,
        sizes: &SplitSizes,
        comm: &Communicator,
    ) -> Result<Tensor<Self, D>, CommError> {
        comm.all_to_all_split(x, dim, sizes)
    }
}

impl CommBackend for Flex {}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> CommBackend for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

/// The GPU backends of cubecl (CUDA and the others), with and without burn's fusion.
#[cfg(feature = "cuda")]
mod cubecl_backends {
    use burn::tensor::backend::DeviceOps;
    use burn_cubecl::cubecl::server::ComputeServer;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_fusion::{Fusion, FusionBackend};

    use super::CommBackend;

    impl<R, F, I, BT> CommBackend for CubeBackend<R, F, I, BT>
    where
        R: CubeRuntime,
        R::Server: ComputeServer,
        R::Device: DeviceOps,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
    }

    impl<B: FusionBackend> CommBackend for Fusion<B> {}
}

/// The backward step of a region operation: the adjoint's forward on the incoming gradient.
#[derive(Debug)]
struct RegionBackward<const D: usize>;

impl<B: Backend, const D: usize> Backward<B, 1> for RegionBackward<D> {
    type State = (Communicator, RegionOp);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (comm, op) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grad));
            match op.adjoint().forward(grad, &comm) {
                Ok(grad) => grad.into_primitive().tensor(),
                Err(error) => panic!("backward of {op:?} failed: {error}"),
            }
        });
    }
}

impl<B: Backend, C: CheckpointStrategy> CommBackend for Autodiff<B, C> {
    fn region_op<const D: usize>(
        x: Tensor<Self, D>,
        comm: &Communicator,
        op: RegionOp,
    ) -> Result<Tensor<Self, D>, CommError> {
        let x = x.into_primitive().tensor();
        let inner = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
        let output = op.forward(inner, comm)?.into_primitive().tensor();
        let output = match RegionBackward::<D>
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((comm.clone(), op), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
    }

    fn region_matmul<const D: usize>(
        x: Tensor<Self, D>,
        w: Tensor<Self, 2>,
        comm: &Communicator,
        op: RegionOp,
        chunks: usize,
    ) -> Result<Tensor<Self, D>, CommError> {
        collective_matmul::autodiff(x, w, comm, op, chunks)
    }

    fn ring_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        comm: &Communicator,
        attention: RingAttention,
    ) -> Result<Tensor<Self, 4>, CommError> {
        ring_attention::autodiff(q, k, v, comm, attention)
    }

    fn all_to_all_split<const D: usize>(
        x: Tensor<Self, D>,
        dim: usize,
        sizes: &SplitSizes,
        comm: &Communicator,
    ) -> Result<Tensor<Self, D>, CommError> {
        all_to_all_split::autodiff(x, dim, sizes, comm)
    }
}

/// Sends part `r` of `x` along `dim` (`sizes.send[r]` rows) to rank `r` and concatenates the
/// parts received (`sizes.recv[r]` rows from rank `r`) in rank order, as
/// [`Communicator::all_to_all_split`]; on `Autodiff` its backward sends the gradient back the
/// same way (the sizes swapped). Expert parallelism's token exchange.
pub fn all_to_all_split<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    dim: usize,
    sizes: &SplitSizes,
    comm: &Communicator,
) -> Result<Tensor<B, D>, CommError> {
    B::all_to_all_split(x, dim, sizes, comm)
}

/// Identity forward, all-reduce backward: enters a column-parallel region.
pub fn copy_to_parallel_region<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
) -> Result<Tensor<B, D>, CommError> {
    B::region_op(x, comm, RegionOp::Copy)
}

/// All-reduce forward, identity backward: leaves a row-parallel region.
pub fn reduce_from_parallel_region<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
) -> Result<Tensor<B, D>, CommError> {
    B::region_op(x, comm, RegionOp::Reduce)
}

/// Keeps this rank's part along `dim`; backward all-gathers the gradient.
pub fn scatter_to_parallel_region<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    B::region_op(x, comm, RegionOp::Scatter { dim })
}

/// All-gathers along `dim`; backward keeps this rank's part of the gradient.
pub fn gather_from_parallel_region<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    B::region_op(x, comm, RegionOp::Gather { dim })
}

/// All-gathers the sequence shards along `dim`; backward reduce-scatters the gradient.
pub fn gather_from_sequence_parallel_region<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    B::region_op(x, comm, RegionOp::SequenceGather { dim })
}

/// Reduce-scatters along the sequence `dim`; backward all-gathers the gradient.
pub fn reduce_scatter_to_sequence_parallel_region<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    comm: &Communicator,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    B::region_op(x, comm, RegionOp::SequenceReduceScatter { dim })
}

/// `op` fused with `x @ w` (`w` is `[in, out]`, `x` has the features last) and cut into
/// `chunks`, so the communication of one chunk runs while the next is multiplied; differentiated
/// on `Autodiff`, whose backward overlaps the same way.
///
/// | `op` | forward | backward: `x`'s gradient |
/// |---|---|---|
/// | `Copy` | `x @ w` | all-reduce of `g @ wᵀ`, chunked |
/// | `SequenceGather { dim }` | all-gather of `x` along `dim`, `@ w`, chunked | reduce-scatter of `g @ wᵀ`, chunked |
/// | `Reduce` | all-reduce of `x @ w`, chunked | `g @ wᵀ` |
/// | `SequenceReduceScatter { dim }` | reduce-scatter of `x @ w` along `dim`, chunked | all-gather of `g`, `@ wᵀ`, chunked |
///
/// The same result as the region op and the matmul one after the other, up to the rounding of
/// a matmul cut into rows. `chunks` is clamped to 1 ..= the rows that are cut (`x`'s length
/// along `dim` for the gather, a rank's block of it for the reduce-scatter, all rows for the
/// all-reduce), so 0 runs fused in one chunk. With one chunk the all-gather still overlaps the
/// multiplication of this rank's own rows. `Scatter` and `Gather` are refused.
pub fn region_matmul<B: CommBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
) -> Result<Tensor<B, D>, CommError> {
    B::region_matmul(x, w, comm, op, chunks)
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::CommBackend;
    use burn::backend::{Autodiff, Cuda};

    #[test]
    fn the_cuda_backends_run_region_ops() {
        fn is_comm_backend<B: CommBackend>() {}
        is_comm_backend::<Cuda>();
        is_comm_backend::<Autodiff<Cuda>>();
    }
}
