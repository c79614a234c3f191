//! Collective bandwidth of burn-comm's local transport, shaped like nccl-tests: for every
//! operation, world size and message size, the time of one call, the algorithm bandwidth and
//! the bus bandwidth, beside a plain memcpy of the same bytes measured in the same run.
//!
//! `cargo run --release -p benches --bin collectives -- --help`

use std::time::{Duration, Instant};

use benches::collectives::{Op, elements, human, iterations, sizes, slowest_median, time_rank};
use burn_comm::launch;
use clap::Parser;
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

/// The median time of `iters` calls of `op` on `world` ranks: each call's time is the slowest
/// rank's, measured from a barrier.
fn time_collective(op: Op, world: usize, elems: usize, iters: usize) -> Duration {
    let per_rank: Vec<Vec<Duration>> =
        launch(world, |ctx| time_rank(ctx.world(), op, elems, iters))
            .into_iter()
            .map(|r| r.expect("rank failed"))
            .collect();
    slowest_median(&per_rank)
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
        .skip(2);
    Duration::from_secs_f64(benches::median(times.map(|t| t.as_secs_f64())))
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
            for bytes in sizes(args.min_bytes, args.max_bytes, args.step) {
                let elems = elements(bytes, world);
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
            }
        }
    }
    println!();
    benches::write_json(&args.json, &rows);
}
