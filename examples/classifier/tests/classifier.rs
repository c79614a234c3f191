//! The example as a user runs it: burn-train on one device and data-parallel give the same
//! model when they read the same batches; a resumed run ends where the whole run does; bad
//! flags are refused with a sentence.

use std::process::Command;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn_comm::launch;
use classifier::{Classifier, Evaluation, TrainConfig, train};

type B = Autodiff<Flex>;

fn model(config: &TrainConfig) -> Classifier<B> {
    B::seed(&Default::default(), config.seed);
    let model = Classifier::<B>::new(config.width, &Default::default());
    model.clone().load_record(model.into_record())
}

fn data_parallel(config: &TrainConfig, ranks: usize) -> Vec<Evaluation> {
    let model = model(config);
    launch(ranks, |rank| {
        train(config, model.clone(), Default::default(), Some(&rank))
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect()
}

#[test]
fn two_and_four_ranks_train_the_model_one_device_trains() {
    let dir = tempfile::tempdir().unwrap();
    let config = TrainConfig {
        epochs: 3,
        global_batch: 48,
        shuffle: false,
        ..TrainConfig::new(dir.path().join("one"))
    };
    let one = train(&config, model(&config), Default::default(), None).unwrap();
    assert!(one.accuracy > 0.8, "the classifier learns: {one:?}");
    for ranks in [2, 4] {
        let config = TrainConfig {
            dir: dir.path().join(format!("dp{ranks}")),
            ..config.clone()
        };
        for (rank, got) in data_parallel(&config, ranks).into_iter().enumerate() {
            assert!(
                (got.loss - one.loss).abs() <= 1e-5 * one.loss,
                "rank {rank} of {ranks}: loss {} vs one device's {}",
                got.loss,
                one.loss
            );
            assert_eq!(got.accuracy, one.accuracy, "rank {rank} of {ranks}");
        }
    }
}

fn classifier(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_classifier"))
        .args(args)
        .output()
        .expect("the classifier runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_resumed_data_parallel_run_ends_where_the_whole_run_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_string_lossy().to_string();
    let (ok, whole) = classifier(&["--ranks", "2", "--epochs", "3", "--dir", &path("whole")]);
    assert!(ok, "{whole}");
    let (ok, first) = classifier(&["--ranks", "2", "--epochs", "2", "--dir", &path("part")]);
    assert!(ok, "{first}");
    let (ok, rest) = classifier(&[
        "--ranks",
        "2",
        "--epochs",
        "3",
        "--resume",
        "2",
        "--dir",
        &path("part"),
    ]);
    assert!(ok, "{rest}");
    assert!(
        whole.contains("trained on 2 rank(s): validation loss"),
        "{whole}"
    );
    assert_eq!(rest, whole);
}

#[test]
fn bad_flags_are_refused_with_a_sentence() {
    let (ok, text) = classifier(&["--ranks", "2", "--batch-size", "63"]);
    assert!(!ok && text.contains("multiple of 2"), "{text}");
    let (ok, text) = classifier(&["--ranks", "0"]);
    assert!(!ok && text.contains("at least 1"), "{text}");
    let (ok, text) = classifier(&["--lr", "nan"]);
    assert!(
        !ok && text.contains("--lr NaN is not a positive number"),
        "{text}"
    );
}

/// Under mpirun every rank is a process: the run prints what the same ranks as threads print,
/// once (rank 0), and a job of the wrong size is refused.
#[cfg(feature = "mpi")]
#[test]
fn ranks_as_processes_train_what_ranks_as_threads_train() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let flags = |name: &str| {
        let dir = path(name);
        ["--ranks", "2", "--epochs", "2", "--no-shuffle", "--dir"]
            .into_iter()
            .map(String::from)
            .chain([dir])
            .collect::<Vec<_>>()
    };
    let threads = Command::new(env!("CARGO_BIN_EXE_classifier"))
        .args(flags("threads"))
        .output()
        .unwrap();
    assert!(threads.status.success(), "{threads:?}");
    let processes = burn_comm::mpirun(2)
        .arg(env!("CARGO_BIN_EXE_classifier"))
        .args(flags("processes"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&processes.stdout).to_string()
        + &String::from_utf8_lossy(&processes.stderr);
    assert!(processes.status.success(), "{text}");
    assert_eq!(
        String::from_utf8_lossy(&processes.stdout),
        String::from_utf8_lossy(&threads.stdout),
        "{text}"
    );
    let wrong = burn_comm::mpirun(3)
        .arg(env!("CARGO_BIN_EXE_classifier"))
        .args(flags("wrong"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success());
    assert!(
        text.contains("--ranks 2 but the job has 3 processes"),
        "{text}"
    );
}
