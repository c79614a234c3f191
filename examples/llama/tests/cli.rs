//! The `llama` binary end to end: train writes one metrics line per step and a checkpoint that
//! `eval` reads back; `--init-from` resumes from it; bad input gets a sentence, not a panic.

use std::path::PathBuf;
use std::process::{Command, Output};

fn llama(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_llama"))
        .args(args)
        .output()
        .expect("the llama binary runs")
}

/// Fails the test, showing the command's stderr, unless the command succeeded.
fn assert_succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("llama-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn train_writes_metrics_and_weights_that_eval_and_init_from_read() {
    let dir = scratch("train");
    let (metrics, weights) = (dir.join("metrics.jsonl"), dir.join("weights"));
    let out = llama(&[
        "train",
        "--steps",
        "3",
        "--dp",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--metrics",
        metrics.to_str().unwrap(),
        "--save",
        weights.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("loss floor"), "{stdout}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "one line per step, written by one rank");
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], i + 1);
        assert_eq!(line["tokens"], 4 * 16);
        for key in ["loss", "lr", "tokens_per_s", "seconds"] {
            assert!(line[key].as_f64().unwrap() > 0.0, "{key} in {line}");
        }
    }
    for file in ["config.json", "model.safetensors", "model.mpk"] {
        assert!(weights.join(file).exists(), "{file}");
    }

    let tokens = dir.join("tokens.txt");
    std::fs::write(&tokens, "1 2 3 4 5\n\n6 7 8\n").unwrap();
    let out = llama(&[
        "eval",
        "--weights",
        weights.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["predicted_tokens"], 6);
    assert_eq!(report["sequences"], 2);
    let ce = report["mean_cross_entropy"].as_f64().unwrap();
    assert!(ce > 0.0 && ce < 6.0, "{ce}");

    let out = llama(&[
        "train",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--init-from",
        weights.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn f16_under_zero_reports_its_loss_scale_and_saves_fp32_weights() {
    let dir = scratch("f16");
    let (metrics, weights) = (dir.join("metrics.jsonl"), dir.join("weights"));
    let out = llama(&[
        "train",
        "--steps",
        "2",
        "--dp",
        "2",
        "--zero",
        "3",
        "--dtype",
        "f16",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--metrics",
        metrics.to_str().unwrap(),
        "--save",
        weights.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("zero: stage 3, f16 parameters with fp32 master weights, gradients reduced in f16, loss scaled dynamically from 65536"),
        "{stdout}"
    );
    for line in std::fs::read_to_string(&metrics).unwrap().lines() {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(line["loss_scale"], 65536.0, "{line}");
        assert_eq!(line["skipped"], false, "{line}");
    }
    let stored = safetensors::SafeTensors::deserialize(
        &std::fs::read(weights.join("model.safetensors")).unwrap(),
    )
    .unwrap()
    .tensor("lm_head.weight")
    .unwrap()
    .dtype();
    assert_eq!(
        stored,
        safetensors::Dtype::F32,
        "the master weights are saved"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn trains_on_a_text_file_read_as_bytes() {
    let dir = scratch("bytes");
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let out = llama(&[
        "train",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--data",
        text.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("1800 bytes, 112 samples of 17 bytes"),
        "{stdout}"
    );
    assert!(
        !stdout.contains("loss floor"),
        "a text file has no known floor: {stdout}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn text_goes_through_a_tokenizer_for_training_and_eval() {
    let dir = scratch("tokenizer");
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let tokenizer = fixture.join("tokenizer.json");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json")).unwrap())
            .unwrap();
    let sample = expected["text"].as_str().unwrap();
    let data = dir.join("corpus.txt");
    std::fs::write(&data, format!("{sample}\n").repeat(40)).unwrap();
    let weights = dir.join("weights");
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--data",
            data.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
        ];
        args.extend(extra);
        llama(&args)
    };
    let out = train(&["--save", weights.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_succeeded(&out);
    // 40 copies of the sample's ids and a newline's.
    assert!(stdout.contains("tokens, "), "{stdout}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(weights.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["vocab_size"], 320,
        "the model takes the tokenizer's vocabulary"
    );
    let caches = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension() == Some("tokens".as_ref()))
        .count();
    assert_eq!(caches, 1, "the ids are cached beside the data");
    // Resuming with the same tokenizer works, again from the cache.
    let out = train(&["--init-from", weights.to_str().unwrap()]);
    assert_succeeded(&out);

    // eval --text gives what eval --tokens gives for the ids of Hugging Face's package.
    let text = dir.join("sample.txt");
    std::fs::write(&text, format!("{sample}\n")).unwrap();
    let ids = dir.join("ids.txt");
    let lines: Vec<String> = expected["line_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|line| {
            let ids: Vec<String> = line
                .as_array()
                .unwrap()
                .iter()
                .map(|id| id.to_string())
                .collect();
            ids.join(" ") + "\n"
        })
        .collect();
    assert_eq!(lines.len(), 2, "the sample's two non-empty lines");
    std::fs::write(&ids, lines.concat()).unwrap();
    let eval = |args: &[&str]| {
        let out = llama(&[&["eval", "--weights", weights.to_str().unwrap()], args].concat());
        assert_succeeded(&out);
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(
        eval(&[
            "--text",
            text.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap()
        ]),
        eval(&["--tokens", ids.to_str().unwrap()])
    );
    // A model whose vocabulary cannot hold the tokenizer's ids is refused.
    let bytes_model = dir.join("bytes-model");
    let short = "--steps 1 --batch-size 2 --seq-len 16";
    let out = llama(
        &[
            &["train", "--save", bytes_model.to_str().unwrap()],
            &short.split(' ').collect::<Vec<_>>()[..],
        ]
        .concat(),
    );
    assert_succeeded(&out);
    let out = llama(&[
        "eval",
        "--weights",
        bytes_model.to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("gives 320 ids, but the model's vocabulary has 256"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn plan_prints_every_stage_of_the_papers_example() {
    let out = llama(&["plan", "--params", "7.5e9", "--dp", "64"]);
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    // ZeRO paper, section 5.1: 120, 31.4, 16.6 and 1.88 GB per device.
    for figure in ["120.000", "31.406", "16.641", "1.875"] {
        assert!(table.contains(figure), "{figure} missing from\n{table}");
    }
}

#[test]
fn print_plan_shows_each_parameters_placement_and_trains_nothing() {
    let dir = scratch("print-plan");
    let metrics = dir.join("metrics.jsonl");
    let out = llama(&[
        "train",
        "--dp",
        "2",
        "--pp",
        "2",
        "--tp",
        "2",
        "--print-plan",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let plan = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "dp 2 x pp 2 x tp 2 = 8 ranks",
        "layers.*.self_attn.q_proj",
        "column-parallel",
        "[128, 128]      [128, 64]",
        "layers.*.mlp.down_proj                   row-parallel",
        "lm_head                                  vocab-parallel columns",
        "stage 1 (pp rank 1): layers 2..4, norm, lm_head",
    ] {
        assert!(plan.contains(expected), "{expected:?} in\n{plan}");
    }
    assert!(!metrics.exists(), "a printed plan trains nothing");
    let out = llama(&["train", "--cp", "2", "--tp", "2", "--print-plan"]);
    assert!(out.status.success(), "{out:?}");
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(
        plan.contains("dp 1 x pp 1 x cp 2 x tp 2 = 4 ranks"),
        "the context-parallel plan:\n{plan}"
    );
    // A layout that cannot be split is refused before anything is printed.
    let out = llama(&["train", "--tp", "3", "--print-plan"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tp 3 does not divide"),
        "{out:?}"
    );
}

#[test]
fn plan_searches_the_layouts_of_a_cluster_and_prints_the_command_of_the_best() {
    let out = llama(&[
        "plan",
        "--gpus",
        "16",
        "--cluster",
        "a100",
        "--model",
        "llama-7b",
        "--global-batch",
        "64",
        "--top",
        "2",
    ]);
    assert_succeeded(&out);
    let report = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "llama-7b (6.738e9 parameters) on 2 x DGX A100 80GB (16 devices of 80 GB), 64 samples of 2048 tokens per step, bf16",
        "fit in 72 GB per device",
        "1    --dp ",
        "2    --dp ",
        "run it: burn-launch --nnodes 2 --nproc-per-node 8 -- llama train --model llama-7b --batch-size 64 --seq-len 2048 --dp ",
    ] {
        assert!(report.contains(expected), "{expected:?} in\n{report}");
    }
    assert!(
        !report.contains("3    --dp "),
        "--top 2 prints two\n{report}"
    );

    // The preset's figures can be replaced.
    let out = llama(&[
        "plan",
        "--gpus",
        "8",
        "--devices-per-node",
        "4",
        "--device-memory-gb",
        "40",
        "--model",
        "llama-1b",
        "--global-batch",
        "16",
        "--top",
        "1",
    ]);
    assert_succeeded(&out);
    let report = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "on 2 x DGX H100 80GB, figures as given (8 devices of 40 GB)",
        "fit in 36 GB per device",
        "burn-launch --nnodes 2 --nproc-per-node 4 -- llama train --model llama-1b",
    ] {
        assert!(report.contains(expected), "{expected:?} in\n{report}");
    }
}

#[test]
fn the_command_a_plan_for_this_machine_prints_trains() {
    let out = llama(&[
        "plan",
        "--gpus",
        "2",
        "--cluster",
        "cpu",
        "--model",
        "tiny",
        "--global-batch",
        "8",
        "--seq-len",
        "32",
        "--dtype",
        "f32",
        "--top",
        "1",
    ]);
    assert_succeeded(&out);
    let report = String::from_utf8_lossy(&out.stdout);
    let command = report
        .lines()
        .find_map(|line| line.strip_prefix("run it: llama "))
        .unwrap_or_else(|| panic!("a command to run in\n{report}"));
    let mut args: Vec<&str> = command.split_whitespace().collect();
    args.extend(["--steps", "2"]);
    let out = llama(&args);
    assert_succeeded(&out);
}

#[test]
fn bad_input_gets_a_sentence() {
    let cases: [(&[&str], &str); 63] = [
        (
            &[
                "plan",
                "--gpus",
                "2",
                "--cluster",
                "cpu",
                "--devices-per-node",
                "2",
                "--model",
                "tiny",
                "--global-batch",
                "8",
            ],
            "--devices-per-node belongs to the GPU presets",
        ),
        (
            &[
                "plan",
                "--gpus",
                "8",
                "--model",
                "tiny",
                "--global-batch",
                "8",
                "--dtype",
                "f32",
            ],
            "to plan --dtype f32, give the device's fp32 (or TF32) peak with --peak-tflops",
        ),
        (
            &[
                "plan",
                "--gpus",
                "8",
                "--devices-per-node",
                "0",
                "--model",
                "tiny",
                "--global-batch",
                "8",
            ],
            "--devices-per-node must be at least 1",
        ),
        (
            &[
                "plan",
                "--gpus",
                "8",
                "--model",
                "tiny",
                "--global-batch",
                "8",
                "--peak-tflops",
                "0",
            ],
            "--peak-tflops 0: give a positive number",
        ),
        (
            &[
                "plan",
                "--gpus",
                "0",
                "--model",
                "tiny",
                "--global-batch",
                "8",
            ],
            "--gpus, --global-batch, --seq-len and --top must be at least 1",
        ),
        (
            &[
                "plan",
                "--gpus",
                "8",
                "--config",
                "Cargo.toml",
                "--global-batch",
                "8",
            ],
            "Cargo.toml is not JSON",
        ),
        (&["plan", "--config", "config.json"], "--gpus"),
        (
            &["plan", "--gpus", "8", "--model", "tiny"],
            "--gpus needs --global-batch",
        ),
        (
            &[
                "plan",
                "--gpus",
                "12",
                "--model",
                "tiny",
                "--global-batch",
                "12",
            ],
            "--gpus 12: a cluster of 8-GPU nodes has up to 8 GPUs or a multiple of 8",
        ),
        (
            &[
                "plan",
                "--gpus",
                "8",
                "--cluster",
                "tpu",
                "--model",
                "tiny",
                "--global-batch",
                "8",
            ],
            "unknown --cluster tpu; choose one of h100, a100, cpu",
        ),
        (
            &["plan", "--model", "small", "--sp"],
            "--sp splits the norms along the sequence over the tensor-parallel ranks; give --tp 2 or more",
        ),
        (
            &["plan", "--model", "small-moe", "--tp", "2", "--sp"],
            "which a mixture of experts cannot run with (llama train refuses it); drop --sp",
        ),
        (&["train", "--dp", "0"], "--dp must be at least 1"),
        (&["train", "--cp", "0"], "--cp must be at least 1"),
        (
            &["train", "--cp", "2", "--seq-len", "30"],
            "--seq-len 30 does not divide by 4",
        ),
        (
            &["train", "--cp", "2", "--strategy", "parameter-server"],
            "use --strategy ddp (the default with --cp)",
        ),
        (
            &["train", "--cp", "2", "--tp", "4", "--sp", "--seq-len", "20"],
            "each rank holds 10 tokens of a sequence, which --sp splits over the 4 tensor-parallel ranks, but 10 does not divide by 4; choose a --seq-len that is a multiple of 8",
        ),
        (
            &[
                "export",
                "--checkpoint",
                "/no/such/dir",
                "--out",
                "/tmp/llama-export-cli",
            ],
            "/no/such/dir does not exist",
        ),
        (
            &[
                "export",
                "--checkpoint",
                "/tmp",
                "--out",
                "/proc/llama-export",
            ],
            "--out /proc/llama-export: ",
        ),
        (
            &["train", "--checkpoint-dir", "/tmp/llama-ckpt-cli"],
            "--checkpoint-dir needs --checkpoint-every N",
        ),
        (
            &[
                "train",
                "--checkpoint-dir",
                "/tmp/llama-ckpt-cli",
                "--checkpoint-every",
                "2",
                "--checkpoint-keep",
                "0",
            ],
            "--checkpoint-keep 0 would remove every checkpoint",
        ),
        (
            &["train", "--checkpoint-dir", "/proc/ckpt", "--resume"],
            "--checkpoint-dir /proc/ckpt: ",
        ),
        (
            &[
                "train",
                "--dp",
                "2",
                "--nccl",
                "--checkpoint-dir",
                "/tmp/llama-ckpt-cli",
                "--resume",
            ],
            // Checkpoints are taken under NCCL; NCCL wants GPUs.
            "--nccl moves CUDA tensors between GPUs; use it with --device cuda",
        ),
        (
            &["train", "--batch-size", "0"],
            "--batch-size must be at least 1",
        ),
        (
            &["train", "--pp", "2", "--virtual-stages", "0"],
            "--virtual-stages must be at least 1",
        ),
        (
            &["train", "--save", "/proc/llama-weights"],
            "--save /proc/llama-weights: ",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--schedule-svg",
                "/nonexistent/dir/s.svg",
            ],
            "nothing was trained",
        ),
        (
            &[
                "train",
                "--data",
                "/nonexistent.txt",
                "--tokenizer",
                "/nonexistent.json",
            ],
            "cannot load the tokenizer /nonexistent.json",
        ),
        (&["eval", "--weights", "w", "--text", "t"], "--tokenizer"),
        (
            &["train", "--lr", "nan"],
            "--lr NaN: the learning rate must be positive",
        ),
        (
            &["train", "--lr=-1"],
            "--lr -1: the learning rate must be positive",
        ),
        (
            &["train", "--lr", "2"],
            "--lr 2: the learning rate must be positive and at most 1",
        ),
        (
            &["train", "--bucket-mb", "inf"],
            "--bucket-mb inf: a bucket holds",
        ),
        (&["train", "--max-shard-size", "5TB"], "`5TB` is not a size"),
        (
            &["train", "--max-shard-size", "0"],
            "`0` is not a size of at least one byte",
        ),
        (
            &["train", "--dp", "2", "--nccl"],
            "use it with --device cuda",
        ),
        (
            &["train", "--clip-grad-norm", "0"],
            "clip to a positive finite norm",
        ),
        (
            &["train", "--clip-grad-norm", "1", "--tp", "2"],
            "drop --tp, --pp, --ep or the parameter server to clip",
        ),
        // 16 x 100,000 tokens' attention scores: terabytes, refused before any is allocated.
        (
            &["train", "--seq-len", "100000"],
            "GB is available; lower --seq-len or --micro-batch-size",
        ),
        (
            &["train", "--ep", "2"],
            "but this model has none; use --model tiny-moe",
        ),
        (
            &["train", "--model", "tiny-moe", "--ep", "3"],
            "--ep 3 does not divide the 8 experts of each block",
        ),
        (
            &["train", "--moe-aux-coef", "0.1"],
            "--moe-aux-coef sets a mixture of experts' router, but this model has none",
        ),
        (
            &[
                "train",
                "--pp",
                "4",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "2",
            ],
            "lower --pp or --virtual-stages",
        ),
        (
            &[
                "train",
                "--pp",
                "4",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "1",
            ],
            "--virtual-stages 2 or more",
        ),
        (
            &[
                "train",
                "--pp",
                "2",
                "--batch-size",
                "6",
                "--micro-batches",
                "3",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                "2",
            ],
            "use a multiple of 2",
        ),
        (
            &["train", "--balance", "time"],
            "--balance belong to pipeline parallelism",
        ),
        (
            &["train", "--dp", "2", "--schedule-svg", "x.svg"],
            "--schedule-svg, --virtual-stages",
        ),
        (&["train", "--tp", "3"], "choose --tp among 1, 2, 4"),
        (
            &["train", "--tp", "2", "--sp", "--seq-len", "63"],
            "multiple of 2",
        ),
        (&["train", "--sp"], "use it with --tp 2 or more"),
        (
            &["train", "--tp-overlap", "2"],
            "--tp-overlap overlaps the tensor-parallel ranks' communication; use it with --tp 2",
        ),
        (
            &["train", "--dp", "3", "--batch-size", "8"],
            "multiple of 3",
        ),
        (&["train", "--model", "huge"], "choose one of tiny"),
        (
            &["train", "--dp", "2", "--zero", "2", "--offload"],
            "in host memory already",
        ),
        (&["train", "--dp", "2", "--offload"], "add --zero 1, 2 or 3"),
        (
            &["train", "--dtype", "bf16"],
            "keep fp32 master weights in ZeRO's sharded optimizer; add --zero 1, 2 or 3",
        ),
        (
            &["train", "--zero", "1", "--fp32-reduce"],
            "use it with --dtype bf16 or f16",
        ),
        (
            &["train", "--dp", "2", "--zero", "2", "--pp", "2"],
            "only ZeRO-1 helps there",
        ),
        (
            &[
                "train",
                "--dp",
                "2",
                "--zero",
                "3",
                "--strategy",
                "parameter-server",
            ],
            "use it with --strategy ddp",
        ),
        (
            &["plan", "--dp", "8"],
            "give --model PRESET or --params COUNT",
        ),
        (&["plan", "--params", "0.2"], "is not a parameter count"),
        (
            &["train", "--batch-size", "8", "--micro-batch-size", "3"],
            "divides 8",
        ),
        (
            &[
                "eval",
                "--weights",
                "/nonexistent",
                "--tokens",
                "/nonexistent",
            ],
            "cannot read",
        ),
    ];
    for (args, expected) in cases {
        let out = llama(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn a_run_stopped_after_a_checkpoint_resumes_where_it_stopped() {
    let dir = scratch("resume");
    let checkpoints = dir.join("checkpoints");
    let run = |metrics: &str, extra: &[&str]| {
        let metrics = dir.join(metrics);
        let args = [
            &[
                "train",
                "--steps",
                "4",
                "--batch-size",
                "4",
                "--seq-len",
                "16",
                "--checkpoint-dir",
                checkpoints.to_str().unwrap(),
                "--metrics",
                metrics.to_str().unwrap(),
            ][..],
            extra,
        ]
        .concat();
        let out = llama(&args);
        assert_succeeded(&out);
        std::fs::read_to_string(metrics)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
            .collect::<Vec<_>>()
    };
    let saved = dir.join("saved");
    let whole = run(
        "whole.jsonl",
        &["--checkpoint-every", "2", "--save", saved.to_str().unwrap()],
    );
    assert_eq!(whole.len(), 4);
    assert!(checkpoints.join("step-00000004").exists());
    assert_eq!(
        std::fs::read_to_string(checkpoints.join("latest")).unwrap(),
        "step-00000004\n"
    );
    // The last checkpoint, exported, is what the run would have saved; from a step's
    // directory, the one of that step.
    let exported = dir.join("exported");
    let out = llama(&[
        "export",
        "--checkpoint",
        checkpoints.to_str().unwrap(),
        "--out",
        exported.to_str().unwrap(),
    ]);
    assert_succeeded(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("after step 4"));
    let tokens = dir.join("tokens.txt");
    std::fs::write(&tokens, "1 2 3 4 5 6 7\n").unwrap();
    let eval = |weights: &std::path::Path| {
        let out = llama(&[
            "eval",
            "--weights",
            weights.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
        ]);
        assert_succeeded(&out);
        out.stdout
    };
    assert_eq!(
        eval(&exported),
        eval(&saved),
        "export gives --save's weights"
    );
    let step_two = dir.join("step-two");
    let out = llama(&[
        "export",
        "--checkpoint",
        checkpoints.join("step-00000002").to_str().unwrap(),
        "--out",
        step_two.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("after step 2"));
    assert_ne!(eval(&step_two), eval(&saved));
    // As if it had died before step 4's checkpoint.
    std::fs::remove_dir_all(checkpoints.join("step-00000004")).unwrap();
    let resumed = run("resumed.jsonl", &["--resume"]);
    assert_eq!(resumed, whole[2..], "steps 3 and 4 again, the same bits");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Every line of a metrics file: its step and loss.
#[cfg(unix)]
fn steps_and_losses(path: &std::path::Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
        .collect()
}

/// `llama train` for 24 steps of `tiny`, checkpointing into `checkpoints` with `extra`.
#[cfg(unix)]
fn long_run(checkpoints: &std::path::Path, metrics: &std::path::Path, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_llama"));
    command
        .args([
            "train",
            "--steps",
            "24",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
        ])
        .arg("--checkpoint-dir")
        .arg(checkpoints)
        .arg("--metrics")
        .arg(metrics)
        .args(extra);
    command
}

/// Waits until `path` exists.
#[cfg(unix)]
fn wait_for(path: &std::path::Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[cfg(unix)]
#[test]
fn a_sigterm_checkpoints_the_step_and_a_sigkill_at_any_moment_loses_nothing_checkpointed() {
    let dir = scratch("signals");
    let whole = dir.join("whole.jsonl");
    let out = long_run(&dir.join("unused"), &whole, &["--checkpoint-every", "100"])
        .output()
        .unwrap();
    assert_succeeded(&out);
    let whole = steps_and_losses(&whole);
    assert_eq!(whole.len(), 24);

    // SIGTERM (preemption) once training is under way: the run ends after its step with a
    // checkpoint and says how to go on; the resumed run ends as the whole one did.
    let checkpoints = dir.join("term");
    let metrics = dir.join("term.jsonl");
    let mut child = long_run(&checkpoints, &metrics, &["--checkpoint-every", "100"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    while steps_and_losses(&metrics).len() < 2 {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    assert!(killed.unwrap().success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "EX_TEMPFAIL: {stderr}");
    assert!(
        stderr.contains("stopped by a signal after step") && stderr.contains("--resume"),
        "{stderr}"
    );
    let before = steps_and_losses(&metrics);
    assert!(
        before.len() < 24,
        "the signal came too late to test anything"
    );
    let out = long_run(
        &checkpoints,
        &metrics,
        &["--checkpoint-every", "100", "--resume"],
    )
    .output()
    .unwrap();
    assert_succeeded(&out);
    assert_eq!(
        steps_and_losses(&metrics),
        whole,
        "stopped and resumed, the whole run's bits"
    );

    // SIGKILL at a moment drawn from the clock, checkpointing every step: whatever it
    // interrupted, a save included, the run resumes from the last committed step.
    let checkpoints = dir.join("kill");
    let metrics = dir.join("kill.jsonl");
    let keeping = ["--checkpoint-every", "1", "--checkpoint-keep", "2"];
    let mut child = long_run(&checkpoints, &metrics, &keeping).spawn().unwrap();
    wait_for(&checkpoints.join("latest"));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    std::thread::sleep(std::time::Duration::from_micros(u64::from(
        nanos.subsec_nanos() % 40_000,
    )));
    child.kill().unwrap();
    child.wait().unwrap();
    // Resumed into the killed run's own metrics, whose lines past its last checkpoint (one is
    // added should the kill have come before any) the resumed run writes again: once each.
    let latest = std::fs::read_to_string(checkpoints.join("latest")).unwrap();
    let from: usize = latest.trim().trim_start_matches("step-").parse().unwrap();
    assert!(
        from >= 1 && from < whole.len(),
        "resumable after step {from}"
    );
    let written = std::fs::read_to_string(&metrics).unwrap();
    if written.lines().count() <= from {
        let next = std::fs::read_to_string(dir.join("whole.jsonl")).unwrap();
        let mut lines: Vec<&str> = written.lines().collect();
        lines.extend(next.lines().skip(lines.len()).take(1));
        std::fs::write(&metrics, lines.join("\n") + "\n").unwrap();
    }
    let out = long_run(
        &checkpoints,
        &metrics,
        &[&keeping[..], &["--resume"]].concat(),
    )
    .output()
    .unwrap();
    assert_succeeded(&out);
    assert_eq!(
        steps_and_losses(&metrics),
        whole,
        "every step once, resumed after step {from}"
    );
    // --checkpoint-keep 2: the last two steps' checkpoints, and nothing a kill left behind.
    let mut left: Vec<String> = std::fs::read_dir(&checkpoints)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["latest", "step-00000023", "step-00000024"]);
    std::fs::remove_dir_all(dir).unwrap();
}
