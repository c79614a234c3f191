//! What one rank has asked of one group: calls and payload bytes per kind of collective, for
//! benches that compare the traffic of a strategy with its theory.

use crate::call::Op;

/// Calls and payload bytes of one kind of collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Calls issued.
    pub calls: u64,
    /// Bytes of the tensors this rank passed in (for an all-gather its own part, for a
    /// reduce-scatter the whole input): the message size of nccl-tests, before any algorithm.
    pub bytes: u64,
}

impl OpStats {
    fn add(&mut self, bytes: u64) {
        self.calls += 1;
        self.bytes += bytes;
    }
}

/// Traffic of one rank in one group, since the communicator was made or last reset. Counts
/// calls as issued (not those refused for their arguments), including those of a one-rank
/// group, which move nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// All-reduces.
    pub all_reduce: OpStats,
    /// All-gathers.
    pub all_gather: OpStats,
    /// Reduce-scatters.
    pub reduce_scatter: OpStats,
    /// Broadcasts (every rank counts the tensor it passes).
    pub broadcast: OpStats,
    /// All-to-alls.
    pub all_to_all: OpStats,
    /// Point-to-point sends.
    pub send: OpStats,
}

impl CommStats {
    pub(crate) fn record(&mut self, op: Op, bytes: u64) {
        let slot = match op {
            Op::AllReduce(_) => &mut self.all_reduce,
            Op::AllGather { .. } => &mut self.all_gather,
            Op::ReduceScatter { .. } => &mut self.reduce_scatter,
            Op::Broadcast { .. } => &mut self.broadcast,
            Op::AllToAll { .. } => &mut self.all_to_all,
            Op::Barrier | Op::Split => return,
        };
        slot.add(bytes);
    }

    pub(crate) fn record_send(&mut self, bytes: u64) {
        self.send.add(bytes);
    }

    /// Bytes a rank sends over the wire under ring algorithms, for a group of `size` ranks:
    /// all-reduce `2(p-1)/p` of its message, all-gather `(p-1)` parts, reduce-scatter `(p-1)/p`
    /// of its input, all-to-all `(p-1)/p`, sends in full; broadcast `(p-1)/p` of the message,
    /// the average over the ranks of a pipelined ring (the root and the middle ranks send it
    /// all, the last none).
    pub fn ring_bytes(&self, size: usize) -> f64 {
        let p = size as f64;
        let share = (p - 1.0) / p;
        2.0 * share * self.all_reduce.bytes as f64
            + (p - 1.0) * self.all_gather.bytes as f64
            + share
                * (self.reduce_scatter.bytes + self.broadcast.bytes + self.all_to_all.bytes) as f64
            + self.send.bytes as f64
    }
}
