//! `classifier --ranks N`: trains the spiral classifier with burn-train on one device (N = 1) or
//! data-parallel as N ranks, and prints the validation result. The ranks are threads of this
//! process, or processes when it is started by `mpirun -n N` (built with `--features mpi`) or by
//! `burn-launch --torchrun-env --nproc-per-node N`.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn_comm::{Process, RankContext, launch};
use clap::Parser;
use classifier::{Classifier, TrainConfig, train};

type B = Autodiff<Flex>;

#[derive(Parser, Debug)]
#[command(about = "Train a spiral classifier with burn-train, on one device or data-parallel")]
struct Args {
    /// Ranks to train on; 1 is burn-train's own single-device training.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    #[arg(long, default_value_t = 6)]
    epochs: usize,
    /// Samples per optimizer step, over all ranks.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Where burn-train writes logs and checkpoints.
    #[arg(long, default_value = "target/classifier")]
    dir: PathBuf,
    /// Resume after this epoch from the checkpoint in --dir.
    #[arg(long)]
    resume: Option<usize>,
    /// Read the training set in order every epoch (results then agree across --ranks).
    #[arg(long)]
    no_shuffle: bool,
    /// Show burn-train's progress.
    #[arg(long)]
    render: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match Process::from_env() {
        Err(e) => Err(e.to_string()),
        Ok(None) => run(&args, None),
        Ok(Some(process)) => {
            // This process is one rank; a rank that fails ends the whole job, naming it.
            let lead = process.rank() == 0;
            let line = process.run(|ctx| run(&args, Some(ctx)));
            if lead {
                println!("{line}");
            }
            return ExitCode::SUCCESS;
        }
    };
    match result {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Trains as asked; `process` is this process's rank when the ranks are processes.
fn run(args: &Args, process: Option<RankContext>) -> Result<String, String> {
    if args.ranks == 0 || args.epochs == 0 || args.batch_size == 0 {
        return Err("--ranks, --epochs and --batch-size must be at least 1".into());
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(format!("--lr {} is not a positive number", args.lr));
    }
    let config = TrainConfig {
        epochs: args.epochs,
        global_batch: args.batch_size,
        lr: args.lr,
        resume: args.resume,
        shuffle: !args.no_shuffle,
        render: args.render,
        ..TrainConfig::new(&args.dir)
    };
    let device = Default::default();
    // One initial model, seeded here; under data parallelism rank 0's copy is broadcast.
    B::seed(&device, config.seed);
    let model = Classifier::<B>::new(config.width, &device);
    // burn initialises parameters lazily and every clone of an uninitialised one draws its own
    // values: take them now, so each rank's clone is this model.
    let model = model.clone().load_record(model.into_record());

    let evaluation = if let Some(ctx) = process {
        if ctx.world_size() != args.ranks {
            return Err(format!(
                "--ranks {} but the job has {} processes; start it with `mpirun -n {}` or `burn-launch --nproc-per-node {}`",
                args.ranks,
                ctx.world_size(),
                args.ranks,
                args.ranks
            ));
        }
        train(&config, model, device, Some(&ctx))?
    } else if args.ranks == 1 {
        train(&config, model, device, None)?
    } else {
        let results = launch(args.ranks, |rank| {
            train(&config, model.clone(), device, Some(&rank))
        });
        let mut first = None;
        for result in results {
            let evaluation = result.map_err(|e| e.to_string())?;
            first.get_or_insert(evaluation);
        }
        first.expect("at least one rank")
    };
    Ok(format!(
        "trained on {} rank(s): validation loss {:.6}, accuracy {:.2}%",
        args.ranks,
        evaluation.loss,
        100.0 * evaluation.accuracy
    ))
}
