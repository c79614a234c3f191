//! A run's peak of live heap memory against `llama plan`'s estimate of it (model state and
//! activations; `llama train` checks the same estimate before its first step). One test: the
//! count is of the whole process, whose thread ranks all count.

use benches::memory::{CountingAllocator, live_bytes, peak_bytes, reset_peak};
use burn::backend::{Autodiff, Flex};
use burn_pipeline::ScheduleKind;
use burn_zero::ZeroStage;
use llama::LlamaConfig;
use llama::data::MarkovSource;
use llama::train::{Strategy, TrainConfig, train};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// The error the estimate is stated with (README, BENCHMARKS.md).
const WITHIN: f64 = 0.2;

#[test]
fn a_runs_peak_memory_is_within_20_percent_of_the_plans_estimate() {
    let model = LlamaConfig::preset("small").unwrap();
    let layout = |seq_len: usize, set: &dyn Fn(&mut TrainConfig)| {
        // Two steps: the second's forward is the first with the optimizer's state.
        let mut config = TrainConfig::new(model.clone(), 2);
        config.seq_len = seq_len;
        set(&mut config);
        config
    };
    let data_parallel = |stage| {
        move |c: &mut TrainConfig| {
            (c.dp, c.strategy, c.zero) = (2, Strategy::Ddp, stage);
        }
    };
    let cases = [
        ("one device", layout(64, &|_| {})),
        // What `llama plan --gpus 2 --cluster cpu --model small` puts first.
        (
            "tp 2 + sp",
            layout(64, &|c| (c.tp, c.sequence_parallel) = (2, true)),
        ),
        ("dp 2", layout(64, &data_parallel(ZeroStage::Replicated))),
        (
            "dp 2, zero 2",
            layout(64, &data_parallel(ZeroStage::Gradients)),
        ),
        // Stage 3 keeps one block's activations and the others' inputs.
        (
            "dp 2, zero 3, 256 tokens",
            layout(256, &data_parallel(ZeroStage::Parameters)),
        ),
        (
            "pp 2 1f1b, 4 micro-batches",
            layout(64, &|c| {
                (c.pp, c.schedule) = (2, ScheduleKind::OneFOneB);
                c.micro_batch_size = Some(2);
            }),
        ),
    ];
    let mut failures = Vec::new();
    for (what, config) in cases {
        let (_, estimate) = llama::plan::process_bytes(&config, &config.layout().unwrap()).unwrap();
        let data = MarkovSource::new(16, 3, config.seq_len, 1 << 10, 1);
        let before = live_bytes();
        reset_peak();
        train::<Autodiff<Flex>>(&config, &data, &Default::default(), &mut |_| {}).unwrap();
        let measured = peak_bytes().saturating_sub(before);
        let ratio = measured as f64 / estimate as f64;
        println!(
            "{what:28} estimated {:7.1} MB, measured {:7.1} MB: {:+.1} %",
            estimate as f64 / 1e6,
            measured as f64 / 1e6,
            (ratio - 1.0) * 100.0
        );
        if (ratio - 1.0).abs() > WITHIN {
            failures.push(format!("{what}: measured / estimated = {ratio:.3}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
