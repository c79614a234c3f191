//! Collective bandwidth of burn-comm's local transport, shaped like nccl-tests: for every
//! operation, world size and message size, the time of one call, the algorithm bandwidth and
//! the bus bandwidth, beside a plain memcpy of the same bytes measured in the same run.
//!
//! `cargo run --release -p benches --bin collectives -- --help`

use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use burn_comm::{Communicator, ReduceOp, launch};
use clap::{Parser, ValueEnum};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Collective bandwidth of burn-comm's local transport, beside memcpy")]
struct Args {
    /// World sizes to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4])]
    worlds: Vec<usize>,
    /// Operations to measure.
    #[arg(long, value_delimiter = ',', default_values_t = Op::all())]
    ops: Vec<Op>,
    /// Smallest message, in bytes.
    #[arg(long, default_value_t = 4 << 10)]
    min_bytes: usize,
    /// Largest message, in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Each size is this factor times the previous one.
    #[arg(long, default_value_t = 4)]
    step: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/collectives.json")]
    json: String,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Op {
    fn all() -> Vec<Op> {
        vec![
            Op::AllReduce,
            Op::AllGather,
            Op::ReduceScatter,
            Op::Broadcast,
        ]
    }

    /// nccl-tests' factor from algorithm to bus bandwidth: the fraction of the data every rank
    /// must move over its link in an optimal algorithm.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::Broadcast => 1.0,
        }
    }

    /// Elements each rank brings for a message of `elems` (nccl-tests' size: the whole buffer
    /// for all-reduce and broadcast, the gathered output for all-gather, the input for
    /// reduce-scatter).
    fn input_elems(self, elems: usize, n: usize) -> usize {
        match self {
            Op::AllGather => elems / n,
            _ => elems,
        }
    }

    fn run(self, comm: &Communicator, x: Tensor<Flex, 1>) -> Tensor<Flex, 1> {
        let result = match self {
            Op::AllReduce => comm.all_reduce(x, ReduceOp::Sum),
            Op::AllGather => comm.all_gather(x, 0),
            Op::ReduceScatter => comm.reduce_scatter(x, ReduceOp::Sum, 0),
            Op::Broadcast => comm.broadcast(x, 0),
        };
        result.expect("collective failed")
    }

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
        }
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name().replace('_', "-"))
    }
}

#[derive(Serialize)]
struct Row {
    op: Op,
    world: usize,
    bytes: usize,
    iterations: usize,
    time_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    memcpy_gbps: f64,
    busbw_over_memcpy: f64,
}

/// Enough iterations for about 2 GB moved, within [5, 200].
fn iterations(bytes: usize) -> usize {
    ((2usize << 30) / bytes.max(1)).clamp(5, 200)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// The median time of `iters` calls of `op` on `world` ranks: each call's time is the slowest
/// rank's, measured from a barrier.
fn time_collective(op: Op, world: usize, elems: usize, iters: usize) -> Duration {
    let per_rank = launch(world, |ctx| {
        let comm = ctx.world();
        let values = vec![1.0f32; op.input_elems(elems, world)];
        let len = values.len();
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            // A fresh, uniquely owned input: burn hands its buffer over without a copy.
            let x = Tensor::<Flex, 1>::from_data(
                TensorData::new(values.clone(), [len]),
                &Default::default(),
            );
            comm.barrier()?;
            let start = Instant::now();
            let out = op.run(comm, x);
            let elapsed = start.elapsed();
            drop(out);
            // No rank prepares its next input while a peer is still being timed.
            comm.barrier()?;
            if i >= 2 {
                times.push(elapsed);
            }
        }
        Ok::<_, burn_comm::CommError>(times)
    });
    let per_rank: Vec<Vec<Duration>> = per_rank
        .into_iter()
        .map(|r| r.expect("rank failed"))
        .collect();
    let slowest = (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).max().unwrap())
        .collect();
    median(slowest)
}

/// The median time of copying `bytes` between two existing buffers on one thread.
fn time_memcpy(bytes: usize, iters: usize) -> Duration {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let times = (0..iters + 2)
        .map(|_| {
            let start = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            start.elapsed()
        })
        .skip(2)
        .collect();
    median(times)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn main() {
    let args = Args::parse();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("burn-comm local transport, Flex backend, f32, {cores} cores");
    println!("time: median over iterations of the slowest rank; GB/s = 1e9 bytes/s");
    println!(
        "busbw = algbw x factor (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast 1)"
    );
    println!("memcpy: one thread copying the same bytes between two existing buffers\n");
    println!(
        "{:<15} {:>5} {:>9} {:>11} {:>10} {:>10} {:>11} {:>8}",
        "op", "world", "size", "time (us)", "algbw", "busbw", "memcpy", "ratio"
    );
    let mut rows = Vec::new();
    for &world in &args.worlds {
        for &op in &args.ops {
            let mut bytes = args.min_bytes;
            while bytes <= args.max_bytes {
                // Whole f32 elements, divisible by the world size.
                let elems = (bytes / 4 / world).max(1) * world;
                let size = elems * 4;
                let iters = iterations(size);
                let time = time_collective(op, world, elems, iters).as_secs_f64();
                let memcpy = time_memcpy(size, iters).as_secs_f64();
                let algbw = size as f64 / time / 1e9;
                let busbw = algbw * op.bus_factor(world);
                let memcpy_gbps = size as f64 / memcpy / 1e9;
                println!(
                    "{:<15} {:>5} {:>9} {:>11.1} {:>10.2} {:>10.2} {:>11.2} {:>8.2}",
                    op.name(),
                    world,
                    human(size),
                    time * 1e6,
                    algbw,
                    busbw,
                    memcpy_gbps,
                    busbw / memcpy_gbps
                );
                rows.push(Row {
                    op,
                    world,
                    bytes: size,
                    iterations: iters,
                    time_us: time * 1e6,
                    algbw_gbps: algbw,
                    busbw_gbps: busbw,
                    memcpy_gbps,
                    busbw_over_memcpy: busbw / memcpy_gbps,
                });
                bytes *= args.step;
            }
        }
    }
    println!();
    benches::write_json(&args.json, &rows);
}
