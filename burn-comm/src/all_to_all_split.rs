//! All-to-all with parts of any size (PyTorch's `all_to_all_single` with split sizes, MPI's
//! `Alltoallv`): what expert parallelism needs, since how many tokens go to each rank's experts
//! changes with every batch. Each rank cuts its tensor along a dimension into one part per
//! rank, of the sizes it says, and receives the parts the others cut for it, of the sizes they
//! said (which it must know: exchange the counts first, with an equal all-to-all).
//!
//! The parts travel as point-to-point messages, one per pair of ranks (an empty one where a part
//! has no rows, so the receiver checks every size), so it runs on every transport, NCCL
//! included; its backward is the same exchange with the sizes swapped.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Tensor, TensorPrimitive};

use crate::{CommError, Communicator};

/// The part sizes of one exchange: `send[r]` rows of this rank's tensor go to rank `r`, and
/// `recv[r]` rows come from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSizes {
    /// Rows sent to each rank, in rank order (this rank's own part included).
    pub send: Vec<usize>,
    /// Rows received from each rank, in rank order.
    pub recv: Vec<usize>,
}

impl SplitSizes {
    /// The sizes of the reverse exchange (what the backward sends).
    pub fn reversed(&self) -> Self {
        Self {
            send: self.recv.clone(),
            recv: self.send.clone(),
        }
    }
}

impl Communicator {
    /// Sends part `r` of `tensor` along `dim` (of `sizes.send[r]` rows, in order) to rank `r`
    /// and concatenates along `dim` the parts received, `sizes.recv[r]` rows from rank `r`, in
    /// rank order. Every rank of the group calls it; the sizes must agree (what rank `a` sends
    /// to `b` is what `b` expects from `a`), or the receiving rank fails with a sentence naming
    /// the shapes. Parts may be empty. Not differentiated: see
    /// [`crate::parallel::all_to_all_split`].
    pub fn all_to_all_split<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
        sizes: &SplitSizes,
    ) -> Result<Tensor<B, D, K>, CommError> {
        exchange(tensor, dim, sizes, self)
    }
}

fn exchange<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
    tensor: Tensor<B, D, K>,
    dim: usize,
    sizes: &SplitSizes,
    comm: &Communicator,
) -> Result<Tensor<B, D, K>, CommError> {
    let dims = tensor.dims();
    let invalid = |reason: String| CommError::InvalidArgument {
        op: format!("all_to_all_split(dim {dim}) of {dims:?}"),
        group: comm.group_name().to_string(),
        reason,
    };
    if dim >= D {
        return Err(invalid(format!(
            "dim {dim} is out of range for a {D}-d tensor"
        )));
    }
    let size = comm.size();
    if sizes.send.len() != size || sizes.recv.len() != size {
        return Err(invalid(format!(
            "give one send and one receive size per rank of the group of {size}, not {} and {}",
            sizes.send.len(),
            sizes.recv.len()
        )));
    }
    let total: usize = sizes.send.iter().sum();
    if total != dims[dim] {
        return Err(invalid(format!(
            "the send sizes add up to {total} but the tensor has {} along dim {dim}",
            dims[dim]
        )));
    }
    let me = comm.rank();
    if sizes.send[me] != sizes.recv[me] {
        return Err(invalid(format!(
            "this rank sends itself {} rows but expects {}",
            sizes.send[me], sizes.recv[me]
        )));
    }
    let (device, dtype) = (tensor.device(), tensor.dtype());
    let part_shape = |rows: usize| {
        let mut shape = dims;
        shape[dim] = rows;
        shape
    };
    // Every pair exchanges one message per call, empty parts included: the receiver checks
    // each part's shape, so sizes that disagree fail here, naming them, and no message is left
    // for a later call to take.
    let mut own = None;
    let mut sends = Vec::new();
    let mut start = 0;
    for (rank, &rows) in sizes.send.iter().enumerate() {
        let part = narrow_or_empty(tensor.clone(), dim, start, rows);
        start += rows;
        if rank == me {
            own = Some(part);
        } else {
            sends.push(comm.send_async(part, rank));
        }
    }
    let mut parts = Vec::new();
    for (rank, &rows) in sizes.recv.iter().enumerate() {
        let part = match rank == me {
            true => own.take().expect("this rank's own part"),
            false => comm.recv(rank, part_shape(rows), (&device, dtype))?,
        };
        if rows > 0 {
            parts.push(part);
        }
    }
    for send in sends {
        send.wait()?;
    }
    if parts.is_empty() {
        return Ok(Tensor::empty(part_shape(0), (&device, dtype)));
    }
    Ok(Tensor::cat(parts, dim))
}

/// The backward step: the reverse exchange of the gradient.
#[derive(Debug)]
struct AllToAllSplitBackward<const D: usize>;

impl<B: Backend, const D: usize> Backward<B, 1> for AllToAllSplitBackward<D> {
    type State = (Communicator, usize, SplitSizes);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (comm, dim, sizes) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grad));
            match exchange(grad, dim, &sizes.reversed(), &comm) {
                Ok(grad) => grad.into_primitive().tensor(),
                Err(error) => panic!("backward of all_to_all_split failed: {error}"),
            }
        });
    }
}

/// [`Communicator::all_to_all_split`] on `Autodiff`: the forward on the inner backend, recording
/// the reverse exchange as its backward.
pub(crate) fn autodiff<B: Backend, C: CheckpointStrategy, const D: usize>(
    x: Tensor<Autodiff<B, C>, D>,
    dim: usize,
    sizes: &SplitSizes,
    comm: &Communicator,
) -> Result<Tensor<Autodiff<B, C>, D>, CommError> {
    let x = x.into_primitive().tensor();
    let inner = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
    let output = exchange(inner, dim, sizes, comm)?.into_primitive().tensor();
    let output = match AllToAllSplitBackward::<D>
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((comm.clone(), dim, sizes.clone()), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
}

/// Rows `start..start + rows` of `tensor` along `dim`, or an empty tensor for none: burn's
/// `narrow` refuses a length of zero.
pub(crate) fn narrow_or_empty<B: Backend, const D: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D, K>,
    dim: usize,
    start: usize,
    rows: usize,
) -> Tensor<B, D, K> {
    if rows == 0 {
        let mut shape = tensor.dims();
        shape[dim] = 0;
        return Tensor::empty(shape, (&tensor.device(), tensor.dtype()));
    }
    tensor.narrow(dim, start, rows)
}
