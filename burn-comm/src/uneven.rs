//! Collectives of parts of any size. Reduce-scatter and all-gather as PyTorch's
//! `reduce_scatter` and `all_gather` over lists of unequal tensors: rank `r`'s part along a
//! dimension has `splits[r]` rows. The transports take equal blocks (MPI's
//! `Reduce_scatter_block`, NCCL), so every part travels padded to the largest and the padding
//! is cut off on arrival; the ranks first agree on the sizes, so sizes that differ between
//! ranks fail on every rank with a sentence instead of scattering the wrong rows. And every
//! rank's bytes, as PyTorch's `all_gather_object` gathers what it pickled.

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Int, Tensor, TensorData};

use crate::all_to_all_split::narrow_or_empty;
use crate::{CommError, Communicator, ReduceOp};

impl Communicator {
    /// Combines `tensor` element-wise across the group, as [`Communicator::reduce_scatter`],
    /// and gives rank `r` rows `splits[..r].sum()..splits[..=r].sum()` of the result along
    /// `dim`. Every rank passes the same `splits`, one size per rank (zeros allowed), adding up
    /// to the tensor's size along `dim`. Costs one small all-gather more than an equal split
    /// (the sizes' agreement) and the padding of every part to the largest.
    pub fn reduce_scatter_split<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
        dim: usize,
        splits: &[usize],
    ) -> Result<Tensor<B, D, K>, CommError> {
        let dims = tensor.dims();
        let what = format!("reduce_scatter_split({op}, dim {dim}) of {dims:?}");
        let total = splits
            .iter()
            .try_fold(0usize, |sum, &rows| sum.checked_add(rows));
        let mine = match (dims.get(dim), total) {
            (None, _) => Err(format!("dim {dim} is out of range for a {D}-d tensor")),
            (_, None) => Err(format!("the splits {splits:?} add up to more than a usize")),
            (Some(&rows), Some(total)) if splits.len() == self.size() && total != rows => {
                Err(format!(
                    "the splits {splits:?} add up to {total} but the tensor has {rows} along dim {dim}"
                ))
            }
            (Some(_), Some(_)) => Ok(()),
        };
        self.agree_on_splits::<B>(&what, &tensor.device(), splits, mine)?;
        let widest = splits.iter().copied().max().unwrap_or(0);
        if splits.iter().all(|&rows| rows == widest) {
            return self.reduce_scatter(tensor, op, dim);
        }
        // Each part padded to the widest with rows of the tensor itself: their sums are cut
        // off, and real values cannot make a reduction of integers overflow as garbage can.
        let mut blocks = Vec::with_capacity(2 * splits.len());
        let mut start = 0;
        for &rows in splits {
            if rows > 0 {
                blocks.push(tensor.clone().narrow(dim, start, rows));
            }
            if rows < widest {
                blocks.push(tensor.clone().narrow(dim, 0, widest - rows));
            }
            start += rows;
        }
        let block = self.reduce_scatter(Tensor::cat(blocks, dim), op, dim)?;
        Ok(narrow_or_empty(block, dim, 0, splits[self.rank()]))
    }

    /// Concatenates along `dim`, in rank order, every rank's `tensor`, which has `splits[r]`
    /// rows along `dim` on rank `r` (zero allowed) and the same size along every other
    /// dimension. Every rank passes the same `splits`. Costs one small all-gather more than an
    /// equal [`Communicator::all_gather`] (the sizes' agreement) and the padding of every part
    /// to the largest.
    pub fn all_gather_split<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
        splits: &[usize],
    ) -> Result<Tensor<B, D, K>, CommError> {
        let dims = tensor.dims();
        let what = format!("all_gather_split(dim {dim}) of {dims:?}");
        let rank = self.rank();
        let mine = match dims.get(dim) {
            None => Err(format!("dim {dim} is out of range for a {D}-d tensor")),
            Some(&rows) if splits.len() == self.size() && splits[rank] != rows => Err(format!(
                "this rank's split is {} rows but its tensor has {rows} along dim {dim}",
                splits[rank]
            )),
            Some(_) => Ok(()),
        };
        self.agree_on_splits::<B>(&what, &tensor.device(), splits, mine)?;
        let widest = splits.iter().copied().max().unwrap_or(0);
        if splits.iter().all(|&rows| rows == widest) {
            return self.all_gather(tensor, dim);
        }
        // The padding only travels (nothing computes on it), so it need not be set.
        let padded = match splits[rank] {
            rows if rows == widest => tensor,
            rows => {
                let mut shape = dims;
                shape[dim] = widest - rows;
                let fill = Tensor::empty(shape, (&tensor.device(), tensor.dtype()));
                match rows {
                    0 => fill,
                    _ => Tensor::cat(vec![tensor, fill], dim),
                }
            }
        };
        let gathered = self.all_gather(padded, dim)?;
        // Some part has rows: the splits are not all equal.
        let parts = splits
            .iter()
            .enumerate()
            .filter(|(_, rows)| **rows > 0)
            .map(|(r, &rows)| gathered.clone().narrow(dim, r * widest, rows))
            .collect();
        Ok(Tensor::cat(parts, dim))
    }

    /// Every rank's `bytes`, in rank order, whatever their lengths (PyTorch's
    /// `all_gather_object`, for bytes a caller serialised): the lengths first, then the bytes
    /// padded to the longest, four to a word. They travel in host memory: on this group, or for
    /// a group on NCCL on the host group it was made from ([`Communicator::host`]), which no
    /// other thread may use meanwhile (the ranks would pair its calls differently).
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let invalid = |reason: String| CommError::InvalidArgument {
            op: format!("all_gather_bytes of {} bytes", bytes.len()),
            group: self.group_name().to_string(),
            reason,
        };
        let host = self.host().ok_or_else(|| {
            invalid(
                "bytes travel in host memory, and this group on NCCL was not made from a host group; call it on the group `nccl` was called on".into(),
            )
        })?;
        let device = Default::default();
        let int_tensor = |values: Vec<i32>| {
            let n = values.len();
            Tensor::<Flex, 1, Int>::from_data(TensorData::new(values, [n]), &device)
        };
        let values = |tensor: Tensor<Flex, 1, Int>| -> Vec<i32> {
            let data = tensor.into_data().convert::<i32>();
            data.to_vec().expect("converted to i32")
        };
        // A length no word holds travels as -1, so that every rank fails alike.
        let length = i32::try_from(bytes.len()).unwrap_or(-1);
        let lengths = values(host.all_gather(int_tensor(vec![length]), 0)?);
        let too_long: Vec<usize> = (0..lengths.len()).filter(|&r| lengths[r] < 0).collect();
        if !too_long.is_empty() {
            return Err(invalid(format!(
                "ranks {too_long:?} passed more than {} bytes, which one call cannot carry",
                i32::MAX
            )));
        }
        let longest = lengths.iter().map(|&l| l as usize).max().unwrap_or(0);
        // One word at least: no rank's part of the all-gather is empty.
        let per_rank = longest.div_ceil(4).max(1);
        let mut packed: Vec<i32> = bytes
            .chunks(4)
            .map(|c| {
                let mut word = [0u8; 4];
                word[..c.len()].copy_from_slice(c);
                i32::from_le_bytes(word)
            })
            .collect();
        packed.resize(per_rank, 0);
        let all = values(host.all_gather(int_tensor(packed), 0)?);
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| {
                all[r * per_rank..(r + 1) * per_rank]
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .take(len as usize)
                    .collect()
            })
            .collect())
    }

    /// Every rank's `splits` and whether its own arguments are valid (`mine`), shared with
    /// one all-gather: a rank with bad arguments, or splits other than this rank's, fails the
    /// call on every rank alike, rather than leave the others waiting or scatter the wrong
    /// rows.
    fn agree_on_splits<B: Backend>(
        &self,
        what: &str,
        device: &B::Device,
        splits: &[usize],
        mine: Result<(), String>,
    ) -> Result<(), CommError> {
        let n = self.size();
        let invalid = |reason: String| CommError::InvalidArgument {
            op: what.to_string(),
            group: self.group_name().to_string(),
            reason,
        };
        // The sizes travel as the backend's ints, which may be 32 bits (CUDA's).
        let word = |rows: usize| i32::try_from(rows).ok().map(i64::from);
        let mine = match splits.len() == n {
            false => Err(format!(
                "give one split per rank of the group of {n}, not {}",
                splits.len()
            )),
            true if splits.iter().any(|&rows| word(rows).is_none()) => Err(format!(
                "the splits {splits:?} hold a part of more than {} rows, which the sizes' agreement cannot carry",
                i32::MAX
            )),
            true => mine,
        };
        // Word 0: whether this rank's arguments are valid; then its splits (n of them).
        let mut message = vec![i64::from(mine.is_ok())];
        message.extend((0..n).map(|r| splits.get(r).and_then(|&s| word(s)).unwrap_or(-1)));
        let message = Tensor::<B, 1, Int>::from_data(TensorData::new(message, [n + 1]), device);
        let all = self.all_gather(message, 0)?.into_data().convert::<i64>();
        let all = all.as_slice::<i64>().expect("converted to i64");
        mine.map_err(&invalid)?;
        let refused: Vec<usize> = (0..n).filter(|&r| all[r * (n + 1)] == 0).collect();
        if !refused.is_empty() {
            return Err(invalid(format!(
                "ranks {refused:?} of the group passed arguments they refused (their errors say why)"
            )));
        }
        let theirs = |r: usize| &all[r * (n + 1) + 1..(r + 1) * (n + 1)];
        let mine = theirs(self.rank());
        if let Some(other) = (0..n).find(|&r| theirs(r) != mine) {
            return Err(invalid(format!(
                "rank {other} passed the splits {:?} and this rank {splits:?}; every rank passes the same",
                theirs(other)
            )));
        }
        Ok(())
    }
}
