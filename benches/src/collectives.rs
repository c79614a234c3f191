//! What the collective benches share: the operations measured, how many iterations a size
//! gets, and how one rank times a call of burn-comm (threads of the local transport and MPI
//! processes alike).

use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use burn_comm::{CommError, Communicator, ReduceOp};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    /// Every rank sends a part of its buffer to every rank (expert parallelism's dispatch).
    AllToAll,
    /// Every rank sends its buffer to the next rank of a ring and receives the previous one's
    /// (nccl-tests' sendrecv; pipeline and ring attention's pattern).
    SendRecv,
}

impl Op {
    pub fn all() -> Vec<Op> {
        vec![
            Op::AllReduce,
            Op::AllGather,
            Op::ReduceScatter,
            Op::Broadcast,
            Op::AllToAll,
            Op::SendRecv,
        ]
    }

    /// nccl-tests' factor from algorithm to bus bandwidth: the fraction of the data every rank
    /// must move over its link in an optimal algorithm.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast | Op::SendRecv => 1.0,
        }
    }

    /// Elements each rank brings for a message of `elems` (nccl-tests' size: the whole buffer
    /// for all-reduce and broadcast, the gathered output for all-gather, the input for
    /// reduce-scatter).
    pub fn input_elems(self, elems: usize, n: usize) -> usize {
        match self {
            Op::AllGather => elems / n,
            _ => elems,
        }
    }

    pub fn run(self, comm: &Communicator, x: Tensor<Flex, 1>) -> Tensor<Flex, 1> {
        let result = match self {
            Op::AllReduce => comm.all_reduce(x, ReduceOp::Sum),
            Op::AllGather => comm.all_gather(x, 0),
            Op::ReduceScatter => comm.reduce_scatter(x, ReduceOp::Sum, 0),
            Op::Broadcast => comm.broadcast(x, 0),
            Op::AllToAll => comm.all_to_all(x, 0, 0),
            Op::SendRecv => {
                let (rank, n) = (comm.rank(), comm.size());
                let shape = x.dims();
                comm.send(x, (rank + 1) % n)
                    .and_then(|()| comm.recv((rank + n - 1) % n, shape, &Default::default()))
            }
        };
        result.expect("collective failed")
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
            Op::SendRecv => "send_recv",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name().replace('_', "-"))
    }
}

/// Enough iterations for about 2 GB moved, within [5, 200].
pub fn iterations(bytes: usize) -> usize {
    ((2usize << 30) / bytes.max(1)).clamp(5, 200)
}

/// The message sizes from `min` to `max` bytes, each `step` times the one before.
pub fn sizes(min: usize, max: usize, step: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(min), move |&bytes| Some(bytes * step))
        .take_while(move |&bytes| bytes <= max)
}

/// Whole f32 elements near `bytes`, divisible by the world size.
pub fn elements(bytes: usize, world: usize) -> usize {
    (bytes / 4 / world).max(1) * world
}

/// One rank's times of `iters` calls of `op` on a message of `elems` f32 (after two warm-up
/// calls), each measured from a barrier.
pub fn time_rank(
    comm: &Communicator,
    op: Op,
    elems: usize,
    iters: usize,
) -> Result<Vec<Duration>, CommError> {
    let values = vec![1.0f32; op.input_elems(elems, comm.size())];
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 2 {
        let elapsed = time_call(comm, op, &values)?;
        if i >= 2 {
            times.push(elapsed);
        }
    }
    Ok(times)
}

/// One call of `op` on a fresh tensor holding `values`, timed from a barrier.
pub fn time_call(comm: &Communicator, op: Op, values: &[f32]) -> Result<Duration, CommError> {
    // A fresh, uniquely owned input: burn hands its buffer over without a copy.
    let x = Tensor::<Flex, 1>::from_data(
        TensorData::new(values.to_vec(), [values.len()]),
        &Default::default(),
    );
    comm.barrier()?;
    let start = Instant::now();
    let out = op.run(comm, x);
    let elapsed = start.elapsed();
    drop(out);
    // No rank prepares its next input while a peer is still being timed.
    comm.barrier()?;
    Ok(elapsed)
}

/// The median over iterations of the slowest rank's time.
pub fn slowest_median(per_rank: &[Vec<Duration>]) -> Duration {
    let iters = per_rank[0].len();
    let mut slowest: Vec<Duration> = (0..iters)
        .map(|i| {
            per_rank
                .iter()
                .map(|t| t[i])
                .max()
                .expect("at least one rank")
        })
        .collect();
    slowest.sort();
    slowest[slowest.len() / 2]
}

pub fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
