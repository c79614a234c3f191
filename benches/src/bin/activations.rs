//! `llama plan`'s activation estimate against the bytes a forward really keeps for its
//! backward, measured in the same run: the Llama presets over micro-batch sizes, sequence
//! lengths and compute dtypes (bf16 with the norms and softmaxes in fp32, as the model runs),
//! and per rank with every sequence split over `--cp` context-parallel ranks (ring attention).
//!
//! `cargo run --release -p benches --bin activations -- --help`

use benches::activations::{measured_activation_bytes, measured_context_parallel_activation_bytes};
use benches::{preset, write_json};
use burn::tensor::DType;
use burn_tensor_parallel::CpAttention;
use clap::Parser;
use llama::plan::{ContextSplit, TensorSplit, activation_bytes};
use serde::Serialize;

#[global_allocator]
static ALLOCATOR: benches::memory::CountingAllocator = benches::memory::CountingAllocator;

#[derive(Parser)]
#[command(about = "Activation bytes per micro-batch: measured against llama plan's estimate")]
struct Args {
    /// Model presets.
    #[arg(long, value_delimiter = ',', default_value = "tiny,small")]
    models: Vec<String>,
    /// `micro_batch x seq_len` shapes.
    #[arg(long, value_delimiter = ',', default_value = "1x64,4x64,2x256")]
    shapes: Vec<String>,
    /// Context-parallel sizes to measure besides one device (1: none).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    cp: Vec<usize>,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/activations.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    model: String,
    micro_batch: usize,
    seq_len: usize,
    cp: String,
    dtype: String,
    measured_mb: f64,
    estimated_mb: f64,
    ratio: f64,
}

fn shape(text: &str) -> (usize, usize) {
    let parsed = text
        .split_once('x')
        .and_then(|(mb, seq)| Some((mb.parse().ok()?, seq.parse().ok()?)));
    match parsed {
        Some((mb, seq)) if mb > 0 && seq > 0 => (mb, seq),
        _ => panic!("--shapes takes micro_batch x seq_len pairs such as 4x64, not {text}"),
    }
}

fn main() {
    let args = Args::parse();
    let mut rows = Vec::new();
    println!(
        "{:<7} {:>5} {:>5} {:>9} {:>5} {:>12} {:>12} {:>7}",
        "model", "mb", "seq", "cp", "dtype", "measured MB", "estimate MB", "ratio"
    );
    for name in &args.models {
        let config = preset(name);
        // One device, and each context-parallel size by the ring and by all-gather.
        let splits: Vec<ContextSplit> = args
            .cp
            .iter()
            .flat_map(|&ranks| match ranks {
                1 => vec![ContextSplit::WHOLE],
                ranks => [CpAttention::Ring, CpAttention::AllGather]
                    .map(|attention| ContextSplit { ranks, attention })
                    .to_vec(),
            })
            .collect();
        let layouts = args.shapes.iter().map(|s| shape(s)).flat_map(|shape| {
            splits
                .iter()
                .filter(move |s| s.ranks == 1 || shape.1.is_multiple_of(2 * s.ranks))
                .map(move |&split| (shape, split))
        });
        for ((micro_batch, seq_len), split) in layouts {
            for dtype in [DType::F32, DType::BF16] {
                let measured = match split.ranks {
                    1 => measured_activation_bytes(&config, micro_batch, seq_len, dtype),
                    cp => measured_context_parallel_activation_bytes(
                        &config,
                        micro_batch,
                        seq_len,
                        dtype,
                        cp,
                        split.attention,
                    ),
                };
                let layers = config.num_hidden_layers;
                let estimated = activation_bytes(
                    &config,
                    micro_batch,
                    seq_len,
                    layers,
                    TensorSplit::WHOLE,
                    split,
                    dtype.size(),
                );
                let row = Row {
                    model: name.clone(),
                    micro_batch,
                    seq_len,
                    cp: match (split.ranks, split.attention) {
                        (1, _) => "1".into(),
                        (cp, CpAttention::Ring) => format!("{cp} ring"),
                        (cp, CpAttention::AllGather) => format!("{cp} gather"),
                    },
                    dtype: format!("{dtype:?}").to_lowercase(),
                    measured_mb: measured as f64 / 1e6,
                    estimated_mb: estimated as f64 / 1e6,
                    ratio: measured as f64 / estimated as f64,
                };
                println!(
                    "{:<7} {:>5} {:>5} {:>9} {:>5} {:>12.2} {:>12.2} {:>7.3}",
                    row.model,
                    row.micro_batch,
                    row.seq_len,
                    row.cp,
                    row.dtype,
                    row.measured_mb,
                    row.estimated_mb,
                    row.ratio
                );
                rows.push(row);
            }
        }
    }
    write_json(&args.json, &rows);
}
