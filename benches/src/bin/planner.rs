//! The planner's predicted step times against measured ones, in one run: the planner
//! calibrates this machine (`llama plan --cluster cpu`), predicts each layout the train,
//! tensor_parallel, zero, pipeline and expert_parallel benches measure, and context
//! parallelism by the ring and by all-gather, and the same layouts are then trained and timed. The error is `predicted / measured - 1`.
//!
//! `cargo run --release -p benches --bin planner -- --help`

use benches::median;
use burn_pipeline::ScheduleKind;
use burn_tensor_parallel::CpAttention;
use burn_zero::ZeroStage;
use clap::Parser;
use llama::data::MarkovSource;
use llama::planner::search::{burn_parallel, step_layout};
use llama::planner::{Cluster, Shape, calibrate, step_time};
use llama::train::{Strategy, TrainConfig};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "The planner's predicted step times against measured ones")]
struct Args {
    /// Model preset.
    #[arg(long, default_value = "small")]
    model: String,
    /// Model preset with experts, for the expert-parallel rows.
    #[arg(long, default_value = "small-moe")]
    moe_model: String,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Steps per run; the first is not counted.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Rounds over all layouts; the medians pool the rounds.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/planner.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    layout: String,
    ranks: usize,
    predicted_s: f64,
    measured_s: f64,
    error: f64,
}

fn main() {
    let args = Args::parse();
    assert!(args.steps > 1, "--steps must exceed the one warm-up step");
    let model = benches::preset(&args.model);
    let data = MarkovSource::new(16, 3, args.seq_len, 1 << 16, 1);
    // The machine's speed drifts: calibrated before the first round and after every round,
    // each layout's prediction is the median of the calibrations'.
    let mut calibrations = vec![calibrate().expect("the calibration runs")];

    // The layouts of the train, tensor_parallel and zero benches (8 samples per step) and of
    // the pipeline bench (16 samples in 8 micro-batches of 2).
    let config = |batch: usize, strategy, dp, tp, pp| {
        let mut c = TrainConfig::new(model.clone(), args.steps);
        c.batch_size = batch;
        c.seq_len = args.seq_len;
        c.strategy = strategy;
        (c.dp, c.tp, c.pp) = (dp, tp, pp);
        c
    };
    let mut runs: Vec<(String, TrainConfig)> = vec![
        ("single device".into(), config(8, Strategy::Single, 1, 1, 1)),
        ("DDP, dp 2".into(), config(8, Strategy::Ddp, 2, 1, 1)),
        ("tp 2".into(), config(8, Strategy::Single, 1, 2, 1)),
    ];
    let mut sp = config(8, Strategy::Single, 1, 2, 1);
    sp.sequence_parallel = true;
    runs.push(("tp 2 + sp".into(), sp));
    runs.push(("tp 4".into(), config(8, Strategy::Single, 1, 4, 1)));
    for (name, attention) in [
        ("cp 2 ring", CpAttention::Ring),
        ("cp 2 all-gather", CpAttention::AllGather),
    ] {
        let mut c = config(8, Strategy::Ddp, 1, 1, 1);
        (c.cp, c.cp_attention) = (2, attention);
        runs.push((name.into(), c));
    }
    // The expert_parallel bench's mixture: its experts on one device, and split over 2 and 4.
    let moe = benches::preset(&args.moe_model);
    for ep in [1, 2, 4] {
        let mut c = config(8, Strategy::Ddp, 1, 1, 1);
        (c.model, c.ep) = (moe.clone(), ep);
        if ep == 1 {
            c.strategy = Strategy::Single;
        }
        runs.push((format!("{}, ep {ep}", args.moe_model), c));
    }
    for stage in [ZeroStage::OptimizerState, ZeroStage::Parameters] {
        let mut c = config(8, Strategy::Ddp, 2, 1, 1);
        c.zero = stage;
        runs.push((format!("ZeRO-{}, dp 2", stage.number()), c));
    }
    let pipeline = |kind, pp, virtual_stages, recompute| {
        let mut c = config(16, Strategy::Single, 1, 1, pp);
        c.micro_batch_size = Some(2);
        c.schedule = kind;
        c.virtual_stages = virtual_stages;
        c.recompute = recompute;
        c
    };
    runs.push((
        "single device, 8 micro-batches".into(),
        TrainConfig {
            micro_batch_size: Some(2),
            ..config(16, Strategy::Single, 1, 1, 1)
        },
    ));
    for (name, kind, pp, v, recompute) in [
        ("pp 2 gpipe", ScheduleKind::Gpipe, 2, 1, false),
        ("pp 2 1f1b", ScheduleKind::OneFOneB, 2, 1, false),
        (
            "pp 2 interleaved v2",
            ScheduleKind::Interleaved,
            2,
            2,
            false,
        ),
        ("pp 4 1f1b", ScheduleKind::OneFOneB, 4, 1, false),
        ("pp 2 1f1b + recompute", ScheduleKind::OneFOneB, 2, 1, true),
    ] {
        runs.push((name.into(), pipeline(kind, pp, v, recompute)));
    }

    let mut steps: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
    let last = runs.len() - 1;
    benches::interleaved_rounds(&runs, &data, args.repeats, |i, metrics, _| {
        steps[i].extend(metrics[1..].iter().map(|m| m.seconds));
        if i == last {
            calibrations.push(calibrate().expect("the calibration runs"));
        }
    });
    for calibration in &calibrations {
        println!("{calibration:?}");
    }

    println!(
        "\n{:<32} {:>6} {:>14} {:>13} {:>8}",
        "layout", "ranks", "predicted (s)", "measured (s)", "error"
    );
    let mut rows = Vec::new();
    for (i, (name, config)) in runs.iter().enumerate() {
        let layout = config.layout().expect("a bench layout runs");
        let ranks = config.dp * config.ep * config.cp * config.tp * config.pp;
        let predicted = median(calibrations.iter().map(|calibration| {
            let cluster = Cluster::cpu(ranks, calibration, u64::MAX);
            step_time(
                &Shape::llama(&config.model),
                &cluster,
                &burn_parallel(false),
                &step_layout(config, &layout),
            )
            .expect("a bench schedule is valid")
            .total
        }));
        let measured = median(steps[i].iter().copied());
        let row = Row {
            layout: name.clone(),
            ranks,
            predicted_s: predicted,
            measured_s: measured,
            error: predicted / measured - 1.0,
        };
        println!(
            "{:<32} {:>6} {:>14.3} {:>13.3} {:>+7.1}%",
            row.layout,
            row.ranks,
            row.predicted_s,
            row.measured_s,
            100.0 * row.error
        );
        rows.push(row);
    }
    benches::write_json(&args.json, &rows);
}
