//! Cross-entropy over logits split by vocabulary, without ever gathering them: each rank
//! finds its local maximum, sum of exponentials and (if it holds it) the target's logit, and
//! the group combines three numbers per token instead of `vocab` of them.

use burn::tensor::{DType, Int, Tensor};
use burn_comm::ReduceOp;
use burn_comm::parallel::{CommBackend, reduce_from_parallel_region};

use crate::embedding::{check_tokens, local_ids};
use crate::{TensorParallel, TpError};

/// The cross-entropy `-log softmax(logits)[target]` of each of `n` tokens, from this rank's
/// logits `[n, vocab / tp]` (columns `rank * vocab/tp ..`) and the targets `[n]`. Every rank
/// gets the same losses, and on `Autodiff` each rank's logits get their own part of the
/// gradient, `softmax - onehot`.
///
/// It is computed in fp32 whatever the logits' dtype (their gradient comes back in it): a
/// 16-bit sum of exponentials would lose the small probabilities.
///
/// The maximum is taken out for stability only and carries no gradient (the loss does not
/// depend on it); the sum of exponentials and the target's logit are summed over the group
/// with an all-reduce whose backward is the identity.
pub fn vocab_parallel_cross_entropy<B: CommBackend>(
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
    let vocab = part * tp.size();
    check_tokens(&targets, vocab)?;
    let logits = if logits.dtype() == DType::F32 {
        logits
    } else {
        logits.cast(DType::F32)
    };
    let local_max = logits.clone().detach().max_dim(1);
    let max = comm.all_reduce(local_max, ReduceOp::Max)?;
    let shifted = logits - max;
    let sum_exp = reduce_from_parallel_region(shifted.clone().exp().sum_dim(1), comm)?;

    let (ids, keep) = local_ids(targets, tp.rank() * part, part, DType::F32);
    let picked = shifted.gather(1, ids.unsqueeze_dim::<2>(1)) * keep;
    let target = reduce_from_parallel_region(picked, comm)?;
    Ok((sum_exp.log() - target).reshape([n]))
}
