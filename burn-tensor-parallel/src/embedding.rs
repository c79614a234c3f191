//! An embedding table split by vocabulary: each rank holds a contiguous range of token ids,
//! looks up the tokens that fall in it (zeros for the others), and the group sums the results.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, ElementConversion, Int, Tensor};
use burn_comm::parallel::CommBackend;

use crate::{TensorParallel, TpError};

/// An embedding table whose rows (tokens) are split over the group. Its output is the full
/// embedding of every token: all-reduced, or under sequence parallelism reduce-scattered so
/// each rank keeps its part of the sequence.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// This rank's rows, `[vocab / tp, hidden]`.
    pub weight: Param<Tensor<B, 2>>,
    /// Tokens in the whole vocabulary.
    pub vocab_size: usize,
    #[module(skip)]
    tp: TensorParallel,
}

impl<B: CommBackend> VocabParallelEmbedding<B> {
    /// This rank's rows of the full table `[vocab, hidden]`.
    pub fn from_full(weight: Tensor<B, 2>, tp: &TensorParallel) -> Result<Self, TpError> {
        let vocab_size = weight.dims()[0];
        tp.check_divides("the vocabulary", vocab_size)?;
        Ok(Self {
            weight: Param::from_tensor(tp.block_of(weight, 0, tp.size())?),
            vocab_size,
            tp: tp.clone(),
        })
    }

    /// The embeddings of `tokens` `[batch, seq]`, the whole sequence and the same on every
    /// rank: `[batch, seq, hidden]`, or under SP this rank's part of the sequence,
    /// `[batch, seq / tp, hidden]`. Fails on a token outside the vocabulary.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, TpError> {
        vocab_parallel_embedding(self.weight.val(), tokens, self.vocab_size, &self.tp)
    }

    /// The full table `[vocab, hidden]`, gathered from the group (a collective).
    pub fn full(&self) -> Result<Tensor<B, 2>, TpError> {
        self.tp
            .gather_blocks(self.weight.val().detach(), 0, self.tp.size())
    }
}

/// The embeddings of `tokens` `[batch, seq]` from `table`, this rank's rows `[vocab / tp,
/// hidden]` of a table of `vocab_size` tokens: `[batch, seq, hidden]`, the whole sequence and
/// the same on every rank, or under SP this rank's part of the sequence. Each rank looks up
/// the tokens in its range (zeros for the others) and the group sums them. Fails on a token
/// outside the vocabulary.
pub fn vocab_parallel_embedding<B: CommBackend>(
    table: Tensor<B, 2>,
    tokens: Tensor<B, 2, Int>,
    vocab_size: usize,
    tp: &TensorParallel,
) -> Result<Tensor<B, 3>, TpError> {
    let [batch, seq] = tokens.dims();
    let [rows, hidden] = table.dims();
    check_tokens(&tokens, vocab_size)?;
    let start = tp.part(vocab_size).start;
    let (ids, outside) = local_ids(tokens.reshape([batch * seq]), start, rows);
    // Rows looked up for the other ranks' tokens are zeroed.
    let keep = outside.clone().bool_not().float().cast(table.dtype());
    let rows = table.select(0, ids.mask_fill(outside, 0)) * keep.unsqueeze_dim::<2>(1);
    tp.exit(rows.reshape([batch, seq, hidden]))
}

/// `ids` shifted to this rank's range `start..start + len`, and where they fall outside it.
pub(crate) fn local_ids<B: Backend>(
    ids: Tensor<B, 1, Int>,
    start: usize,
    len: usize,
) -> (Tensor<B, 1, Int>, Tensor<B, 1, Bool>) {
    let local = ids - start as i64;
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(len as i64));
    (local, outside)
}

/// Fails unless every token is in `0..vocab_size`: a parallel lookup would otherwise give a
/// silent zero where one device fails. One read back from the device.
pub(crate) fn check_tokens<B: Backend, const D: usize>(
    tokens: &Tensor<B, D, Int>,
    vocab_size: usize,
) -> Result<(), TpError> {
    let outside = tokens
        .clone()
        .lower_elem(0)
        .bool_or(tokens.clone().greater_equal_elem(vocab_size as i64));
    if outside.any().int().into_scalar().elem::<i64>() != 0 {
        return Err(TpError::Config(format!(
            "a token id is outside the vocabulary of {vocab_size}; every id must be in 0..{vocab_size}"
        )));
    }
    Ok(())
}
