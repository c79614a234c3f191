//! A run's peak of live heap memory against `llama plan`'s estimate of it (model state and
//! activations; `llama train` checks the same estimate before its first step). Each layout
//! trains in a process of its own (this test started again), as a user's run would: in one
//! process a run would reuse the buffers (burn-comm's pool, the backend's scratch) that the
//! one before it left.

use benches::memory::{CountingAllocator, live_bytes, peak_bytes, reset_peak};
use burn_pipeline::ScheduleKind;
use burn_zero::ZeroStage;
use llama::LlamaConfig;
use llama::data::MarkovSource;
use llama::train::{Strategy, TrainConfig};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The error the estimate is stated with (BENCHMARKS.md).
const WITHIN: f64 = 0.2;

/// Set in the processes this test starts: the layout to train.
const CASE: &str = "RUN_MEMORY_CASE";

/// What a started process prints: the estimate and the measured peak, in bytes.
const RESULT: &str = "RUN_MEMORY ";

/// The layouts, each with the error it is held within.
fn cases() -> Vec<(&'static str, TrainConfig, f64)> {
    let model = LlamaConfig::preset("small").unwrap();
    let layout = |seq_len: usize, set: &dyn Fn(&mut TrainConfig)| {
        // Four steps: the optimizer's state comes with the first, and burn-comm's pool of
        // result buffers fills over the next ones.
        let mut config = TrainConfig::new(model.clone(), 4);
        config.seq_len = seq_len;
        set(&mut config);
        config
    };
    let data_parallel = |stage| {
        move |c: &mut TrainConfig| {
            (c.dp, c.strategy, c.zero) = (2, Strategy::Ddp, stage);
        }
    };
    vec![
        ("one device", layout(64, &|_| {}), WITHIN),
        // What `llama plan --gpus 2 --cluster cpu --model small` puts first.
        (
            "tp 2 + sp",
            layout(64, &|c| (c.tp, c.sequence_parallel) = (2, true)),
            WITHIN,
        ),
        (
            "dp 2",
            layout(64, &data_parallel(ZeroStage::Replicated)),
            WITHIN,
        ),
        // Stage 2: the updated weights are gathered beside the old ones.
        (
            "dp 2, zero 2",
            layout(64, &data_parallel(ZeroStage::Gradients)),
            WITHIN,
        ),
        // Stage 3: one block's activations and the others' inputs, a few units whole; and at
        // the end the whole model, gathered once the optimizer's state is let go.
        (
            "dp 2, zero 3",
            layout(64, &data_parallel(ZeroStage::Parameters)),
            WITHIN,
        ),
        (
            "dp 2, zero 3, 256 tokens",
            layout(256, &data_parallel(ZeroStage::Parameters)),
            WITHIN,
        ),
        (
            "pp 2 1f1b, 4 micro-batches",
            layout(64, &|c| {
                (c.pp, c.schedule) = (2, ScheduleKind::OneFOneB);
                c.micro_batch_size = Some(2);
            }),
            WITHIN,
        ),
    ]
}

/// Trains `config` in this process and prints its estimate and measured peak.
fn measure(config: &TrainConfig) {
    let (_, estimate) = llama::plan::process_bytes(config, &config.layout().unwrap()).unwrap();
    let data = MarkovSource::new(16, 3, config.seq_len, 1 << 10, 1);
    let before = live_bytes();
    reset_peak();
    llama::cpu::train(config, &data, &mut |_| {}).unwrap();
    let measured = peak_bytes().saturating_sub(before);
    println!("{RESULT}{estimate} {measured}");
}

#[test]
fn a_runs_peak_memory_is_within_the_stated_error_of_the_plans_estimate() {
    let cases = cases();
    if let Ok(case) = std::env::var(CASE) {
        let i: usize = case.parse().expect("a case's index");
        return measure(&cases[i].1);
    }
    let mut failures = Vec::new();
    for (i, (what, _, within)) in cases.iter().enumerate() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_runs_peak_memory_is_within_the_stated_error_of_the_plans_estimate",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CASE, i.to_string())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let numbers: Vec<f64> = stdout
            .lines()
            // The harness's "test ... " may open the line.
            .find_map(|line| line.split_once(RESULT).map(|(_, result)| result))
            .unwrap_or_else(|| {
                panic!(
                    "{what}: no result\n{stdout}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
            .split(' ')
            .map(|n| n.parse().unwrap())
            .collect();
        let (estimate, measured) = (numbers[0], numbers[1]);
        let ratio = measured / estimate;
        println!(
            "{what:28} estimated {:7.1} MB, measured {:7.1} MB: {:+.1} %",
            estimate / 1e6,
            measured / 1e6,
            (ratio - 1.0) * 100.0
        );
        if (ratio - 1.0).abs() > *within {
            failures.push(format!("{what}: measured / estimated = {ratio:.3}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
