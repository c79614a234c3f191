//! A matmul fused with the collective of a tensor-parallel region and cut into chunks, so the
//! collective of one chunk runs on the communication stream while the caller multiplies the
//! next (the "collective matmul" of XLA, PyTorch's async TP, Megatron's `tp_comm_overlap`).
//!
//! | op | forward | backward: the input's gradient |
//! |---|---|---|
//! | `Copy` | `x @ w` | `all_reduce(g @ wᵀ)`, chunked |
//! | `SequenceGather` | `all_gather(x) @ w`, chunked | `reduce_scatter(g @ wᵀ)`, chunked |
//! | `Reduce` | `all_reduce(x @ w)`, chunked | `g @ wᵀ` |
//! | `SequenceReduceScatter` | `reduce_scatter(x @ w)`, chunked | `all_gather(g) @ wᵀ`, chunked |
//!
//! The backward of an op that enters a region is the forward of the one that leaves it with
//! the weight transposed, and the other way round. The weight's gradient, `inputᵀ @ g`, needs
//! no collective of its own: for the entering ops it is computed while the input's gradient is
//! in flight; for the sequence reduce-scatter it waits for the gathered `g`.

use std::ops::Range;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::parallel::RegionOp;
use crate::{CommError, Communicator, ReduceOp, Work};

/// `x @ w` for `x` of any rank and a `[in, out]` weight.
pub fn matmul<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 2>) -> Tensor<B, D> {
    let dims = x.dims();
    let [d_in, d_out] = w.dims();
    let rows = dims[..D - 1].iter().product();
    let mut out = dims;
    out[D - 1] = d_out;
    x.reshape([rows, d_in]).matmul(w).reshape(out)
}

/// `inputᵀ @ grad` over all rows: the gradient of the weight of `input @ w`.
fn weight_grad<B: Backend, const D: usize>(
    input: Tensor<B, D>,
    grad: Tensor<B, D>,
) -> Tensor<B, 2> {
    let (d_in, d_out) = (input.dims()[D - 1], grad.dims()[D - 1]);
    let rows = input.dims()[..D - 1].iter().product();
    input
        .reshape([rows, d_in])
        .transpose()
        .matmul(grad.reshape([rows, d_out]))
}

/// Whether `op` comes before the matmul (it enters a region) or after it (it leaves one).
fn enters(op: RegionOp, comm: &Communicator) -> Result<bool, CommError> {
    match op {
        RegionOp::Copy | RegionOp::SequenceGather { .. } => Ok(true),
        RegionOp::Reduce | RegionOp::SequenceReduceScatter { .. } => Ok(false),
        RegionOp::Scatter { .. } | RegionOp::Gather { .. } => Err(invalid(
            comm,
            op,
            "only copy, reduce, sequence gather and sequence reduce-scatter fuse with a matmul; apply the region op, then multiply".into(),
        )),
    }
}

fn invalid(comm: &Communicator, op: RegionOp, reason: String) -> CommError {
    CommError::InvalidArgument {
        op: format!("collective matmul ({op:?})"),
        group: comm.group_name().to_string(),
        reason,
    }
}

/// Fails unless `x @ w` is defined and `op`'s dimension exists.
fn check_shapes<const D: usize>(
    x: &[usize; D],
    w: &[usize; 2],
    comm: &Communicator,
    op: RegionOp,
) -> Result<(), CommError> {
    if D < 2 || x[D - 1] != w[0] {
        return Err(invalid(
            comm,
            op,
            format!("input {x:?} cannot be multiplied by a [in, out] weight {w:?}"),
        ));
    }
    if let RegionOp::SequenceGather { dim } | RegionOp::SequenceReduceScatter { dim } = op
        && dim >= D - 1
    {
        return Err(invalid(
            comm,
            op,
            format!("dim {dim} is not a row dimension of a {D}-d input (the last is the features)"),
        ));
    }
    Ok(())
}

/// `0..len` cut into at most `chunks` near-equal, non-empty ranges (one empty range for 0).
fn pieces(len: usize, chunks: usize) -> Vec<Range<usize>> {
    let count = chunks.clamp(1, len.max(1));
    let (base, extra) = (len / count, len % count);
    let mut start = 0;
    (0..count)
        .map(|i| {
            let end = start + base + usize::from(i < extra);
            let piece = start..end;
            start = end;
            piece
        })
        .collect()
}

/// The forward of the fused op on any backend, without recording a graph.
pub(crate) fn forward<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
) -> Result<Tensor<B, D>, CommError> {
    check_shapes(&x.dims(), &w.dims(), comm, op)?;
    Ok(forward_keeping(x, w, comm, op, chunks, false)?.1)
}

/// The fused op's output, and, with `keep_input`, the matmul's input (`enter(x)` or `x`).
fn forward_keeping<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
    keep_input: bool,
) -> Result<(Option<Tensor<B, D>>, Tensor<B, D>), CommError> {
    if enters(op, comm)? {
        return entering_matmul(x, w, comm, op, chunks, keep_input);
    }
    let input = keep_input.then(|| x.clone());
    Ok((
        input,
        start_leaving_matmul(x, w, comm, op, chunks)?.finish()?,
    ))
}

/// `enter(x) @ w`, and, with `keep_input`, `enter(x)` itself (the weight's gradient needs it).
fn entering_matmul<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
    keep_input: bool,
) -> Result<(Option<Tensor<B, D>>, Tensor<B, D>), CommError> {
    let RegionOp::SequenceGather { dim } = op else {
        // Copy: nothing moves forward.
        return Ok((keep_input.then(|| x.clone()), matmul(x, w)));
    };
    let (me, size, len) = (comm.rank(), comm.size(), x.dims()[dim]);
    if len == 0 {
        let full = comm.all_gather(x, dim)?;
        return Ok((keep_input.then(|| full.clone()), matmul(full, w)));
    }
    let parts = pieces(len, chunks);
    let works: Vec<_> = parts
        .iter()
        .map(|p| comm.all_gather_async(x.clone().narrow(dim, p.start, p.len()), dim))
        .collect();
    // This rank's rows need nothing from the others: they are multiplied while the first
    // chunks travel.
    let own = matmul(x, w.clone());
    // The output's and the input's blocks, by rank then chunk: the sequence order.
    let mut out = vec![Vec::with_capacity(parts.len()); size];
    let mut input = keep_input.then(|| vec![Vec::with_capacity(parts.len()); size]);
    for (part, work) in parts.iter().zip(works) {
        let gathered = work.wait()?;
        let n = part.len();
        out[me].push(own.clone().narrow(dim, part.start, n));
        // The ranks before this one and those after it: one matmul each.
        for ranks in [0..me, me + 1..size] {
            if ranks.is_empty() {
                continue;
            }
            let rows = gathered
                .clone()
                .narrow(dim, ranks.start * n, ranks.len() * n);
            let y = matmul(rows, w.clone());
            for (i, rank) in ranks.enumerate() {
                out[rank].push(y.clone().narrow(dim, i * n, n));
            }
        }
        if let Some(input) = &mut input {
            for (rank, blocks) in input.iter_mut().enumerate() {
                blocks.push(gathered.clone().narrow(dim, rank * n, n));
            }
        }
    }
    let join = |blocks: Vec<Vec<Tensor<B, D>>>| Tensor::cat(blocks.concat(), dim);
    Ok((input.map(join), join(out)))
}

/// The chunks of `exit(x @ w)` in flight; [`Leaving::finish`] joins them.
enum Leaving<B: Backend, const D: usize> {
    /// All-reduced chunks of the rows, and the output's shape.
    Rows(Vec<Work<Tensor<B, 2>>>, [usize; D]),
    /// Reduce-scattered chunks of this rank's part of `dim`.
    Sequence(Vec<Work<Tensor<B, D>>>, usize),
}

impl<B: Backend, const D: usize> Leaving<B, D> {
    fn finish(self) -> Result<Tensor<B, D>, CommError> {
        fn wait_all<T>(works: Vec<Work<T>>) -> Result<Vec<T>, CommError> {
            works.into_iter().map(Work::wait).collect()
        }
        match self {
            Leaving::Rows(works, shape) => Ok(Tensor::cat(wait_all(works)?, 0).reshape(shape)),
            Leaving::Sequence(works, dim) => Ok(Tensor::cat(wait_all(works)?, dim)),
        }
    }
}

/// Multiplies `x @ w` chunk by chunk and starts each chunk's collective as soon as it is made.
fn start_leaving_matmul<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
) -> Result<Leaving<B, D>, CommError> {
    let dims = x.dims();
    let RegionOp::SequenceReduceScatter { dim } = op else {
        // Reduce: every row is summed on its own, so any cut of the rows will do.
        let d_in = dims[D - 1];
        let rows: usize = dims[..D - 1].iter().product();
        let mut shape = dims;
        shape[D - 1] = w.dims()[1];
        let x = x.reshape([rows, d_in]);
        if rows == 0 {
            let y = comm.all_reduce_async(x.matmul(w), ReduceOp::Sum);
            return Ok(Leaving::Rows(vec![y], shape));
        }
        let works = pieces(rows, chunks)
            .into_iter()
            .map(|p| {
                let y = x.clone().slice([p, 0..d_in]).matmul(w.clone());
                comm.all_reduce_async(y, ReduceOp::Sum)
            })
            .collect();
        return Ok(Leaving::Rows(works, shape));
    };
    let (size, len) = (comm.size(), dims[dim]);
    if !len.is_multiple_of(size) {
        return Err(invalid(
            comm,
            op,
            format!(
                "size {len} along dim {dim} does not divide by the group size {size}; the sequence must split evenly"
            ),
        ));
    }
    if len == 0 {
        let y = comm.reduce_scatter_async(matmul(x, w), ReduceOp::Sum, dim);
        return Ok(Leaving::Sequence(vec![y], dim));
    }
    let block = len / size;
    // Chunk `c` is the `c`-th piece of every rank's block, so reduce-scattering it gives each
    // rank the `c`-th piece of its own.
    let works = pieces(block, chunks)
        .into_iter()
        .map(|p| {
            let rows = (0..size)
                .map(|rank| x.clone().narrow(dim, rank * block + p.start, p.len()))
                .collect();
            let y = matmul(Tensor::cat(rows, dim), w.clone());
            comm.reduce_scatter_async(y, ReduceOp::Sum, dim)
        })
        .collect();
    Ok(Leaving::Sequence(works, dim))
}

/// The input's gradient and the weight's, each where it is wanted.
type Grads<B, const D: usize> = (Option<Tensor<B, D>>, Option<Tensor<B, 2>>);

/// The gradients of the input (when `need_input`) and of the weight (when the forward kept
/// the matmul's input, `enter(x)` or `x`, for it), from the output's gradient.
fn backward<B: Backend, const D: usize>(
    grad: Tensor<B, D>,
    input: Option<Tensor<B, D>>,
    w: Tensor<B, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
    need_input: bool,
) -> Result<Grads<B, D>, CommError> {
    let w_t = w.transpose();
    if enters(op, comm)? {
        let leaving = need_input
            .then(|| start_leaving_matmul(grad.clone(), w_t, comm, op.adjoint(), chunks))
            .transpose()?;
        let grad_w = input.map(|input| weight_grad(input, grad));
        Ok((leaving.map(Leaving::finish).transpose()?, grad_w))
    } else {
        let (grad_full, grad_x) =
            entering_matmul(grad, w_t, comm, op.adjoint(), chunks, input.is_some())?;
        let grad_w = input.zip(grad_full).map(|(input, g)| weight_grad(input, g));
        Ok((need_input.then_some(grad_x), grad_w))
    }
}

/// The backward step of the fused op.
#[derive(Debug)]
struct CollectiveMatmulBackward<const D: usize>;

impl<B: Backend, const D: usize> Backward<B, 2> for CollectiveMatmulBackward<D> {
    /// The group, the op, the chunk count, the matmul's input (kept when the weight needs a
    /// gradient) and the weight.
    type State = (
        Communicator,
        RegionOp,
        usize,
        Option<FloatTensor<B>>,
        FloatTensor<B>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (comm, op, chunks, input, weight) = ops.state;
        let [x_node, w_node] = ops.parents;
        let float = |t| Tensor::<B, D>::from_primitive(TensorPrimitive::Float(t));
        let grad = float(grads.consume::<B>(&ops.node));
        let weight = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(weight));
        let need_input = x_node.is_some();
        let (grad_x, grad_w) = match backward(
            grad,
            input.map(float),
            weight,
            &comm,
            op,
            chunks,
            need_input,
        ) {
            Ok(grads) => grads,
            Err(error) => panic!("backward of the collective matmul ({op:?}) failed: {error}"),
        };
        if let (Some(node), Some(grad_x)) = (x_node, grad_x) {
            grads.register::<B>(node.id, grad_x.into_primitive().tensor());
        }
        if let (Some(node), Some(grad_w)) = (w_node, grad_w) {
            grads.register::<B>(node.id, grad_w.into_primitive().tensor());
        }
    }
}

/// The fused op on `Autodiff`: the forward on the inner backend, recording the backward.
pub(crate) fn autodiff<B: Backend, C: CheckpointStrategy, const D: usize>(
    x: Tensor<Autodiff<B, C>, D>,
    w: Tensor<Autodiff<B, C>, 2>,
    comm: &Communicator,
    op: RegionOp,
    chunks: usize,
) -> Result<Tensor<Autodiff<B, C>, D>, CommError> {
    check_shapes(&x.dims(), &w.dims(), comm, op)?;
    let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
    let inner_x = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
    let inner_w = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(w.primitive.clone()));
    let output = match CollectiveMatmulBackward::<D>
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            // The matmul's input is kept only for the weight's gradient.
            let keep_input = !w.node.requirement.is_none();
            let (input, y) =
                forward_keeping(inner_x, inner_w.clone(), comm, op, chunks, keep_input)?;
            let state = (
                comm.clone(),
                op,
                chunks,
                input.map(|input| input.into_primitive().tensor()),
                inner_w.into_primitive().tensor(),
            );
            prep.finish(state, y.into_primitive().tensor())
        }
        OpsKind::UnTracked(prep) => {
            let (_, y) = forward_keeping(inner_x, inner_w, comm, op, chunks, false)?;
            prep.finish(y.into_primitive().tensor())
        }
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    // A one-range list is the expected value here, not a mistaken `Vec` of the range.
    #[allow(clippy::single_range_in_vec_init)]
    fn pieces_cover_the_range_evenly() {
        assert_eq!(pieces(7, 3), [0..3, 3..5, 5..7]);
        assert_eq!(pieces(4, 4), [0..1, 1..2, 2..3, 3..4]);
        assert_eq!(pieces(2, 5), [0..1, 1..2]);
        assert_eq!(pieces(5, 0), [0..5]);
        assert_eq!(pieces(0, 3), [0..0]);
    }
}
