//! What the benches share: a heap counter for memory figures, the activations a forward keeps,
//! training runs in interleaved rounds, the median, the model preset of `--model`, token batches, the JSON file of results, and the
//! device a kernel bench runs on.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use llama::LlamaConfig;
use llama::data::{Dataset, MarkovSource};
use serde::Serialize;

pub mod activations;
pub mod collectives;
pub mod kernel_device;
pub mod memory;

/// The preset named by `--model`; a bad name stops the bench with the choices.
pub fn preset(name: &str) -> LlamaConfig {
    LlamaConfig::preset(name).unwrap_or_else(|| {
        panic!(
            "unknown --model {name}; choose one of {:?}",
            llama::config::PRESETS
        )
    })
}

/// Samples `first..first + size` of `data` (wrapping around) as `[size, seq]` inputs and the
/// next tokens they predict.
pub fn token_batch<B: Backend>(
    data: &MarkovSource,
    first: usize,
    size: usize,
    seq: usize,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let tokens: Vec<i64> = (first..first + size)
        .flat_map(|i| data.sample(i % data.len()))
        .map(i64::from)
        .collect();
    let tokens = Tensor::<B, 2, Int>::from_data(
        TensorData::new(tokens, [size, seq + 1]),
        &Default::default(),
    );
    (tokens.clone().narrow(1, 0, seq), tokens.narrow(1, 1, seq))
}

/// Trains each of `runs` (named configurations) on `data`, `repeats` times in interleaved
/// rounds so that drift of the machine's speed hits each alike, and hands every run's step
/// metrics and its peak of live memory (above what was live before it; the process must count
/// with [`memory::CountingAllocator`]) to `record`, with the run's index.
pub fn interleaved_rounds(
    runs: &[(String, llama::train::TrainConfig)],
    data: &MarkovSource,
    repeats: usize,
    mut record: impl FnMut(usize, &[llama::train::StepMetrics], usize),
) {
    for round in 0..repeats {
        for (i, (name, config)) in runs.iter().enumerate() {
            let before = memory::live_bytes();
            memory::reset_peak();
            let mut metrics = Vec::new();
            llama::cpu::train(config, data, &mut |m| metrics.push(*m))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            record(i, &metrics, memory::peak_bytes().saturating_sub(before));
            eprintln!("round {} / {repeats}: {name} done", round + 1);
        }
    }
}

/// Writes `rows` to `path` as JSON, creating its directory, and says so.
pub fn write_json(path: &str, rows: &impl Serialize) {
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir).expect("the JSON directory can be created");
    }
    std::fs::write(path, serde_json::to_string_pretty(rows).unwrap())
        .expect("the JSON file can be written");
    println!("wrote {path}");
}

/// The median of `values` (the mean of the middle two for an even count); NaN when empty.
pub fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.collect();
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}
