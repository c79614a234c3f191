//! Cross-entropy over logits split by vocabulary, without ever gathering them: each rank
//! finds its local maximum, sum of exponentials and (if it holds it) the target's logit, and
//! the group combines three numbers per token instead of `vocab` of them. The local part is
//! burn-kernels' [`cross_entropy_stats`](burn_kernels::KernelBackend::cross_entropy_stats): on
//! a cubecl device one kernel reads the logits once forward and one writes their gradient
//! backward.

use burn::tensor::{DType, Int, Tensor};
use burn_comm::ReduceOp;
use burn_comm::parallel::reduce_from_parallel_region;

use crate::embedding::{check_tokens, local_ids};
use crate::{TensorParallel, TpBackend, TpError};

/// The cross-entropy `-log softmax(logits)[target]` of each of `n` tokens, from this rank's
/// logits `[n, vocab / tp]` (columns `rank * vocab/tp ..`) and the targets `[n]`. Every rank
/// gets the same losses, and on `Autodiff` each rank's logits get their own part of the
/// gradient, `softmax - onehot`.
///
/// It is computed in fp32 whatever the logits' dtype (their gradient comes back in it): a
/// 16-bit sum of exponentials would lose the small probabilities.
///
/// Two all-reduces: the maximum (taken out for stability only, so it carries no gradient),
/// then each rank's sum of exponentials, rescaled to that maximum, together with the target's
/// logit, summed over the group by an all-reduce whose backward is the identity.
pub fn vocab_parallel_cross_entropy<B: TpBackend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    tp: &TensorParallel,
) -> Result<Tensor<B, 1>, TpError> {
    let [n, part] = logits.dims();
    if n == 0 {
        return Err(TpError::Config(
            "no tokens to compute a cross-entropy over; give at least one row of logits".into(),
        ));
    }
    if targets.dims()[0] != n {
        return Err(TpError::Config(format!(
            "{n} rows of logits but {} targets; give one target per row",
            targets.dims()[0]
        )));
    }
    let comm = tp.comm();
    check_tokens(&targets, part * tp.size())?;
    let logits = if logits.dtype() == DType::F32 {
        logits
    } else {
        logits.cast(DType::F32)
    };
    // Each target's column in this rank's part, or -1 where another rank holds it.
    let (local, outside) = local_ids(targets, tp.rank() * part, part);
    let stats = B::cross_entropy_stats(logits, local.mask_fill(outside, -1));
    let max = comm.all_reduce(stats.max.clone(), ReduceOp::Max)?;
    // exp(local max - max) rescales the sum; the target's logit is taken as it is.
    let rescale = Tensor::cat(
        vec![
            (stats.max - max.clone()).exp().reshape([n, 1]),
            Tensor::ones([n, 1], (&max.device(), DType::F32)),
        ],
        1,
    );
    let sums = reduce_from_parallel_region(stats.sums * rescale, comm)?;
    let sum_exp = sums.clone().narrow(1, 0, 1).reshape([n]);
    let target = sums.narrow(1, 1, 1).reshape([n]);
    Ok(sum_exp.log() - (target - max))
}
