//! burn-train's `SupervisedTraining` on one device against the same training data-parallel
//! under burn-parallel-train, in one run: the spiral classifier of `examples/classifier`, a
//! fixed global batch (strong scaling), whole epochs through burn-train (events, validation and
//! checkpoints included, as a user runs it).
//!
//! Every rank is one thread with one compute thread, so N ranks need N cores to scale. The row
//! "N independent runs" trains N single-device Learners at once without communication: the
//! most this machine gives N concurrent ranks. Rounds interleave the configurations
//! (`--repeats`) so drift of the machine's speed hits them alike.
//!
//! `cargo run --release -p benches --bin burn_train -- --help`

use std::path::PathBuf;
use std::time::Instant;

use benches::median;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn_comm::launch;
use clap::Parser;
use classifier::{Classifier, TrainConfig, train};
use serde::Serialize;

type B = Autodiff<Flex>;

#[derive(Parser)]
#[command(about = "burn-train on one device against burn-parallel-train's data parallelism")]
struct Args {
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Units per hidden layer of the classifier.
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Training points per epoch.
    #[arg(long, default_value_t = 32768)]
    points: usize,
    /// Samples per optimizer step, all ranks together.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Rounds over all configurations; the medians pool the rounds.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/burn_train.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    name: String,
    ranks: usize,
    samples_per_s: f64,
    seconds: f64,
    /// Against burn-train on one device, measured in the same run.
    vs_one_device: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Run {
    OneDevice,
    DataParallel,
    Independent,
}

fn main() {
    let args = Args::parse();
    assert!(
        args.world > 0 && args.batch_size % args.world == 0,
        "--batch-size must be a positive multiple of --world"
    );
    let base = std::env::temp_dir().join(format!("burn_train_bench_{}", std::process::id()));
    let config = |name: &str| TrainConfig {
        epochs: args.epochs,
        global_batch: args.batch_size,
        width: args.width,
        train_points: args.points,
        valid_points: 512,
        ..TrainConfig::new(base.join(name))
    };
    let runs = [
        ("burn-train, one device", Run::OneDevice),
        ("burn-parallel-train, data-parallel", Run::DataParallel),
        ("independent runs (ceiling)", Run::Independent),
    ];
    let mut seconds = vec![Vec::new(); runs.len()];
    for round in 0..args.repeats {
        for (i, (name, run)) in runs.iter().enumerate() {
            eprintln!("round {}/{}: {name}", round + 1, args.repeats);
            let dir = format!("{i}-{round}");
            seconds[i].push(time(*run, args.world, &config(&dir)));
            let _ = std::fs::remove_dir_all(base.join(dir));
        }
    }
    let _ = std::fs::remove_dir_all(&base);

    let samples = (args.points * args.epochs) as f64;
    let one_device = median(seconds[0].iter().copied());
    println!(
        "classifier width {}, {} points x {} epochs, global batch {}, {} round(s)",
        args.width, args.points, args.epochs, args.batch_size, args.repeats
    );
    println!(
        "{:<38} {:>5} {:>12} {:>9} {:>8}",
        "", "ranks", "samples/s", "time s", "vs one"
    );
    let rows: Vec<Row> = runs
        .iter()
        .zip(&seconds)
        .map(|((name, run), times)| {
            let s = median(times.iter().copied());
            let ranks = if *run == Run::OneDevice {
                1
            } else {
                args.world
            };
            // Independent runs each train the whole set: their throughput is N sets.
            let done = if *run == Run::Independent {
                samples * args.world as f64
            } else {
                samples
            };
            let row = Row {
                name: name.to_string(),
                ranks,
                samples_per_s: done / s,
                seconds: s,
                vs_one_device: (done / s) / (samples / one_device),
            };
            println!(
                "{:<38} {:>5} {:>12.0} {:>9.2} {:>7.2}x",
                row.name, row.ranks, row.samples_per_s, row.seconds, row.vs_one_device
            );
            row
        })
        .collect();
    let ceiling = rows[2].vs_one_device;
    println!(
        "data-parallel reaches {:.0}% of the independent runs' ceiling",
        100.0 * rows[1].vs_one_device / ceiling
    );
    if let Some(dir) = PathBuf::from(&args.json).parent() {
        std::fs::create_dir_all(dir).expect("the JSON's directory can be made");
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&rows).unwrap())
        .expect("the JSON can be written");
}

/// One seeded model, its values taken so every clone is it (burn initialises lazily).
fn model(config: &TrainConfig) -> Classifier<B> {
    B::seed(&Default::default(), config.seed);
    let model = Classifier::<B>::new(config.width, &Default::default());
    model.clone().load_record(model.into_record())
}

/// Seconds of one whole training.
fn time(run: Run, world: usize, config: &TrainConfig) -> f64 {
    let model = model(config);
    let start = Instant::now();
    match run {
        Run::OneDevice => {
            train(config, model, Default::default(), None).expect("trains");
        }
        Run::DataParallel => {
            for result in launch(world, |rank| {
                train(config, model.clone(), Default::default(), Some(&rank))
            }) {
                result.expect("every rank trains");
            }
        }
        Run::Independent => {
            std::thread::scope(|scope| {
                for r in 0..world {
                    let config = TrainConfig {
                        dir: config.dir.join(format!("run-{r}")),
                        ..config.clone()
                    };
                    let model = model.clone();
                    scope.spawn(move || train(&config, model, Default::default(), None));
                }
            });
        }
    }
    start.elapsed().as_secs_f64()
}
