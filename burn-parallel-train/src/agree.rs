//! What the ranks decide together, so they stop together: once per iteration whether each has
//! a batch and whether one was interrupted; once per epoch the lead's early stopping.

use burn::tensor::Device;
use burn::tensor::backend::Backend;
use burn_comm::{CommError, Communicator};
use burn_ddp::params::{from_ints, to_ints};

/// The outcome of one iteration's agreement, the same on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Agreement {
    /// Every rank has a batch: train on it.
    Go,
    /// No rank has a batch: the epoch is over.
    EpochDone,
    /// `rank` (the lowest that asked) was interrupted: every rank stops before this batch.
    Stop { rank: usize },
    /// Some ranks ran out of batches while others had one.
    Uneven {
        dry: Vec<usize>,
        with_batch: Vec<usize>,
    },
}

/// One all-gather of two flags per rank.
pub(crate) fn agree<B: Backend>(
    comm: &Communicator,
    device: &Device<B>,
    has_batch: bool,
    stop: bool,
) -> Result<Agreement, CommError> {
    let flags = to_ints::<B>(&[has_batch as i64, stop as i64], device);
    let all = from_ints(comm.all_gather(flags, 0)?);
    Ok(decide(&all))
}

/// The decision from every rank's `[has_batch, stop]`, in rank order.
fn decide(all: &[i64]) -> Agreement {
    let ranks = all.len() / 2;
    if let Some(rank) = (0..ranks).find(|&r| all[2 * r + 1] != 0) {
        return Agreement::Stop { rank };
    }
    let (with_batch, dry): (Vec<usize>, Vec<usize>) = (0..ranks).partition(|&r| all[2 * r] != 0);
    match (with_batch.is_empty(), dry.is_empty()) {
        (_, true) => Agreement::Go,
        (true, false) => Agreement::EpochDone,
        (false, false) => Agreement::Uneven { dry, with_batch },
    }
}

/// The ranks whose `ok` is false, the same list on every rank.
pub(crate) fn ranks_failing<B: Backend>(
    comm: &Communicator,
    device: &Device<B>,
    ok: bool,
) -> Result<Vec<usize>, CommError> {
    let all = from_ints(comm.all_gather(to_ints::<B>(&[ok as i64], device), 0)?);
    Ok((0..all.len()).filter(|&r| all[r] == 0).collect())
}

/// The lead's (rank 0's) `flag`, on every rank.
pub(crate) fn agree_on_lead<B: Backend>(
    comm: &Communicator,
    device: &Device<B>,
    flag: bool,
) -> Result<bool, CommError> {
    let flag = to_ints::<B>(&[flag as i64], device);
    Ok(from_ints(comm.broadcast(flag, 0)?)[0] != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_wins_then_batches_decide() {
        assert_eq!(decide(&[1, 0, 1, 0]), Agreement::Go);
        assert_eq!(decide(&[0, 0, 0, 0, 0, 0]), Agreement::EpochDone);
        assert_eq!(decide(&[1, 0, 0, 1, 1, 1]), Agreement::Stop { rank: 1 });
        assert_eq!(
            decide(&[1, 0, 0, 0, 1, 0]),
            Agreement::Uneven {
                dry: vec![1],
                with_batch: vec![0, 2]
            }
        );
    }
}
