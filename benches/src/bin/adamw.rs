//! The fused AdamW kernel against burn's AdamW on a flat fp32 shard, on one device, measured in
//! the same run. AdamW is memory-bound: a step must read the weights, gradient and two moments
//! and write three of them back, 28 bytes per element, so the bandwidth each reaches is printed
//! beside its time (the limit is the device's memory bandwidth).
//!
//! `cargo run --release -p benches --features wgpu --bin adamw -- --device wgpu` (or
//! `--features cuda` and `--device cuda`; `--device cpu` shows the fallback costs nothing).

use std::time::Instant;

use benches::kernel_device::{KernelBench, KernelDevice};
use benches::{median, write_json};
use burn::optim::{AdamWConfig, AdamWState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_kernels::FusedAdamW;
use clap::Parser;
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Fused AdamW kernel against burn's AdamW, time per step")]
struct Args {
    #[arg(long, value_enum, default_value = "cpu")]
    device: KernelDevice,
    /// Shard sizes, in elements.
    #[arg(long, value_delimiter = ',', default_value = "65536,1048576,16777216")]
    elements: Vec<usize>,
    /// Timed steps per figure (after two untimed ones).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/adamw.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    device: String,
    elements: usize,
    burn_ms: f64,
    fused_ms: f64,
    speedup: f64,
    burn_gb_per_s: f64,
    fused_gb_per_s: f64,
}

/// Bytes a step must move per element: four fp32 reads, three writes.
const BYTES_PER_ELEMENT: f64 = 28.0;

type Step<'a, B> = dyn FnMut(Tensor<B, 1>, Tensor<B, 1>, Option<AdamWState<B, 1>>) -> (Tensor<B, 1>, AdamWState<B, 1>)
    + 'a;

/// Median seconds per step of `step` on a `len`-element shard.
fn time<B: Backend>(len: usize, steps: usize, device: &B::Device, step: &mut Step<B>) -> f64 {
    let mut weights = Tensor::<B, 1>::random([len], Distribution::Default, device);
    let grad = Tensor::<B, 1>::random([len], Distribution::Default, device);
    let mut state = None;
    let mut times = Vec::with_capacity(steps);
    for s in 0..steps + 2 {
        B::sync(device).expect("the device syncs");
        let start = Instant::now();
        let (w, st) = step(weights, grad.clone(), state.take());
        B::sync(device).expect("the device syncs");
        if s >= 2 {
            times.push(start.elapsed().as_secs_f64());
        }
        (weights, state) = (w, Some(st));
    }
    median(times.into_iter())
}

fn bench<B: Backend>(name: &str, args: &Args) -> Vec<Row> {
    let device = Default::default();
    let config = AdamWConfig::new().with_weight_decay(0.1);
    let burn_adamw = config.build();
    let fused = FusedAdamW::new(&config);
    if !fused.is_fused::<B>() {
        println!("({name} has no kernel: the fused figure is the fallback, burn's AdamW)");
    }
    println!(
        "{:<6} {:>10} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "device", "elements", "burn ms", "fused ms", "speedup", "burn GB/s", "fused GB/s"
    );
    let mut rows = Vec::new();
    for &len in &args.elements {
        let burn_s = time::<B>(len, args.steps, &device, &mut |w, g, s| {
            let (w, s) = burn_adamw.step(1e-3, w, g, s);
            (w, s.expect("AdamW returns its state"))
        });
        let fused_s = time::<B>(len, args.steps, &device, &mut |w, g, s| {
            fused.step(1e-3, w, g, s)
        });
        let gbps = |s: f64| len as f64 * BYTES_PER_ELEMENT / s / 1e9;
        let row = Row {
            device: name.into(),
            elements: len,
            burn_ms: burn_s * 1e3,
            fused_ms: fused_s * 1e3,
            speedup: burn_s / fused_s,
            burn_gb_per_s: gbps(burn_s),
            fused_gb_per_s: gbps(fused_s),
        };
        println!(
            "{:<6} {:>10} {:>10.3} {:>10.3} {:>8.2} {:>9.1} {:>9.1}",
            row.device,
            row.elements,
            row.burn_ms,
            row.fused_ms,
            row.speedup,
            row.burn_gb_per_s,
            row.fused_gb_per_s
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
