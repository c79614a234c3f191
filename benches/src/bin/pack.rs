//! The pack kernel against burn's `cat`, joining a bucket of flat gradients into one buffer as
//! DDP and ZeRO do before every all-reduce or reduce-scatter, measured in the same run. `cat`
//! writes each part with a launch of its own; the kernel copies up to 32 parts per launch, so
//! on a GPU the difference is in launches, and grows with the number of parts.
//!
//! `cargo run --release -p benches --features wgpu --bin pack -- --device wgpu` (or
//! `--features cuda` and `--device cuda`; `--device cpu` shows the fallback is `cat`).

use std::time::Instant;

use benches::kernel_device::{KernelBench, KernelDevice};
use benches::{median, write_json};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_kernels::pack::{fallback_pack, pack_with_kernel};
use clap::Parser;
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Pack kernel against burn's cat, time per bucket")]
struct Args {
    #[arg(long, value_enum, default_value = "cpu")]
    device: KernelDevice,
    /// Parts per bucket.
    #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
    parts: Vec<usize>,
    /// Elements in each bucket, shared out over its parts.
    #[arg(long, default_value_t = 1 << 22)]
    elements: usize,
    /// Timed packs per figure (after two untimed ones).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/pack.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    device: String,
    parts: usize,
    elements: usize,
    cat_ms: f64,
    pack_ms: f64,
    speedup: f64,
}

/// A bucket of `count` parts of uneven sizes (as a model's parameters are: a few large
/// matrices, many small vectors) holding `elements` in all.
fn bucket<B: Backend>(count: usize, elements: usize, device: &B::Device) -> Vec<Tensor<B, 1>> {
    let weights: Vec<usize> = (0..count).map(|i| 1 + (i * 7) % 13).collect();
    let total: usize = weights.iter().sum();
    weights
        .iter()
        .map(|w| {
            let len = (elements * w / total).max(1);
            Tensor::random([len], Distribution::Default, device)
        })
        .collect()
}

/// Median seconds to join `parts` with `join`.
fn time<B: Backend>(
    parts: &[Tensor<B, 1>],
    steps: usize,
    device: &B::Device,
    join: fn(Vec<Tensor<B, 1>>) -> Tensor<B, 1>,
) -> f64 {
    let mut times = Vec::with_capacity(steps);
    for s in 0..steps + 2 {
        B::sync(device).expect("the device syncs");
        let start = Instant::now();
        let joined = join(parts.to_vec());
        B::sync(device).expect("the device syncs");
        if s >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
        drop(joined);
    }
    median(times.into_iter())
}

fn bench<B: Backend>(name: &str, args: &Args) -> Vec<Row> {
    let device = Default::default();
    if !burn_kernels::has_kernels::<B>() {
        println!("({name} has no kernel: the pack figure is the fallback, cat)");
    }
    println!(
        "{:<6} {:>6} {:>10} {:>10} {:>10} {:>8}",
        "device", "parts", "elements", "cat ms", "pack ms", "speedup"
    );
    let mut rows = Vec::new();
    for &count in &args.parts {
        let parts = bucket::<B>(count, args.elements, &device);
        let elements = parts.iter().map(|p| p.dims()[0]).sum();
        let cat_s = time(&parts, args.steps, &device, fallback_pack::<B>);
        let pack_s = time(&parts, args.steps, &device, pack_with_kernel::<B>);
        let row = Row {
            device: name.into(),
            parts: count,
            elements,
            cat_ms: cat_s * 1e3,
            pack_ms: pack_s * 1e3,
            speedup: cat_s / pack_s,
        };
        println!(
            "{:<6} {:>6} {:>10} {:>10.3} {:>10.3} {:>8.2}",
            row.device, row.parts, row.elements, row.cat_ms, row.pack_ms, row.speedup
        );
        rows.push(row);
    }
    rows
}

impl KernelBench for Args {
    type Output = Vec<Row>;

    fn run<B: Backend>(&self, name: &str) -> Vec<Row> {
        bench::<B>(name, self)
    }
}

fn main() {
    let args = Args::parse();
    let rows = args.device.run(&args);
    write_json(&args.json, &rows);
}
