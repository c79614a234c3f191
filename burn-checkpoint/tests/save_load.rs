//! Checkpoints saved by ranks holding pieces as the layouts do (tensor-parallel blocks held
//! alike by data-parallel replicas, replicated tensors, ZeRO's flat shards, a tensor on one
//! rank only) read back whole and as any other layout's boxes, bit for bit; every distinct
//! piece is written once. A crash leaves the last committed checkpoint; damage is refused
//! naming the file; pieces that disagree, overlap or leave a gap are refused on every rank.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use burn_checkpoint::{
    BackgroundSaver, Checkpoint, CheckpointError, Region, Shard, ShardData, save,
};
use burn_comm::{LaunchConfig, launch, launch_with};
use serde_json::json;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-checkpoint-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The values of a tensor `name` shaped `shape`: distinct per element and per tensor.
fn values(name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let base = name.bytes().map(f32::from).sum::<f32>();
    (0..n).map(|i| base + i as f32 * 0.25).collect()
}

/// The box `region` of a 1-D or 2-D tensor `name` shaped `shape`.
fn cut(name: &str, shape: &[usize], region: &Region) -> TensorData {
    let all = values(name, shape);
    let columns = if shape.len() == 2 { shape[1] } else { 1 };
    let (rows, cols) = match region.offsets.len() {
        1 => (
            (0..1),
            region.offsets[0]..region.offsets[0] + region.extents[0],
        ),
        _ => (
            region.offsets[0]..region.offsets[0] + region.extents[0],
            region.offsets[1]..region.offsets[1] + region.extents[1],
        ),
    };
    let kept: Vec<f32> = rows
        .flat_map(|r| cols.clone().map(move |c| (r, c)))
        .map(|(r, c)| all[r * columns + c])
        .collect();
    TensorData::new(kept, region.extents.clone())
}

fn piece(name: &str, shape: &[usize], region: Region) -> Shard {
    Shard {
        name: name.into(),
        shape: shape.to_vec(),
        data: cut(name, shape, &region).into(),
        region,
    }
}

const W: [usize; 2] = [8, 6];
const M: [usize; 2] = [4, 5];

/// Rank `rank` of dp 2 x tp 2: `w` its tp block (held alike by both replicas), `b` whole on
/// every rank, `m` its quarter as ZeRO flattens it, `steps` on rank 0 only.
fn pieces_of(rank: usize) -> Vec<Shard> {
    let tp = rank % 2;
    let mut shards = vec![
        piece("w", &W, Region::block(&W, 1, tp * 3..tp * 3 + 3)),
        // Handed in as a tensor, read only by the rank that writes it.
        Shard::whole(
            "b",
            ShardData::read_later(Tensor::<Flex, 1>::from_data(
                cut("b", &[5], &Region::whole(&[5])),
                &Default::default(),
            )),
        ),
    ];
    for region in Region::from_flat(&M, rank * 5..rank * 5 + 5) {
        shards.push(piece("m", &M, region));
    }
    if rank == 0 {
        shards.push(Shard::whole(
            "steps",
            TensorData::new(vec![7i64, 8, 9], [3]),
        ));
    }
    shards
}

fn save_four(root: &Path, step: u64) -> Vec<PathBuf> {
    let results = launch(4, |ctx| {
        let meta = json!({ "layout": "dp 2 x tp 2", "step": step });
        save(
            root,
            step,
            Some(ctx.world()),
            Ok(pieces_of(ctx.rank())),
            meta,
        )
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn pieces_saved_in_one_layout_read_back_whole_and_as_another_layouts_boxes() {
    let root = scratch("layouts");
    let dirs = save_four(&root, 7);
    assert!(dirs.iter().all(|d| d == &root.join("step-00000007")));
    let checkpoint = Checkpoint::latest(&root).unwrap().expect("committed");
    assert_eq!((checkpoint.step(), checkpoint.world()), (7, 4));
    assert_eq!(checkpoint.metadata()["layout"], "dp 2 x tp 2");
    assert_eq!(
        checkpoint.names().collect::<Vec<_>>(),
        ["b", "m", "steps", "w"]
    );
    for (name, shape) in [("w", &W[..]), ("b", &[5][..]), ("m", &M[..])] {
        let whole = checkpoint.read_whole(name).unwrap();
        assert_eq!(whole, cut(name, shape, &Region::whole(shape)), "{name}");
    }
    assert_eq!(
        checkpoint.read_whole("steps").unwrap(),
        TensorData::new(vec![7i64, 8, 9], [3])
    );
    // tp 3 blocks, and a box across the saved blocks' seam.
    for region in [
        Region::block(&W, 1, 2..4),
        Region::block(&W, 0, 4..8),
        Region::new(vec![1, 2], vec![5, 3]),
    ] {
        assert_eq!(
            checkpoint.read("w", &region).unwrap(),
            cut("w", &W, &region),
            "{region:?}"
        );
    }
    // Every distinct piece is written once, and the writing is spread over the ranks.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(checkpoint.dir().join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        manifest["tensors"]["w"]["shards"].as_array().unwrap().len(),
        2
    );
    assert_eq!(
        manifest["tensors"]["b"]["shards"].as_array().unwrap().len(),
        1
    );
    let files: Vec<u64> = std::fs::read_dir(checkpoint.dir())
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("data-"))
        .map(|e| e.metadata().unwrap().len())
        .collect();
    let expected = 4 * (48 + 5 + 20) + 8 * 3;
    assert_eq!(files.iter().sum::<u64>(), expected);
    assert!(files.len() >= 3, "the bytes land on most ranks: {files:?}");
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step-00000007\n"
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_background_save_goes_on_beside_the_ranks_collectives_and_writes_what_a_plain_save_does() {
    let root = scratch("background");
    let plain = scratch("background-plain");
    save_four(&plain, 3);
    // Rank 0 starts its save before the ranks' all-reduces, the others after: a save that
    // blocked the caller would leave rank 0 waiting for the others' saves while they wait for
    // its all-reduce, until the timeout.
    let config = LaunchConfig::new(4).with_timeout(std::time::Duration::from_secs(20));
    let sums = launch_with(config, |ctx| {
        let world = ctx.world();
        let mut saver = BackgroundSaver::new(Some(world))?;
        let meta = json!({ "layout": "dp 2 x tp 2", "step": 3 });
        let mut meta = Some(meta);
        let mut start = |saver: &mut BackgroundSaver| {
            saver.start(&root, 3, Ok(pieces_of(ctx.rank())), meta.take().unwrap())
        };
        if ctx.rank() == 0 {
            start(&mut saver)?;
        }
        // Training's collectives while the save runs: its own group keeps them apart.
        let mut sum = 0.0;
        for round in 0..20 {
            let mine = burn::tensor::Tensor::<burn::backend::Flex, 1>::from_floats(
                [(ctx.rank() + round) as f32],
                &Default::default(),
            );
            let total = world.all_reduce(mine, burn_comm::ReduceOp::Sum)?;
            sum += total.into_scalar();
        }
        if ctx.rank() != 0 {
            start(&mut saver)?;
        }
        let saved = saver.wait()?.expect("a save was under way");
        assert_eq!(saved.dir, root.join("step-00000003"));
        Ok::<_, CheckpointError>(sum)
    });
    for sum in sums {
        assert_eq!(
            sum.unwrap(),
            (0..20).map(|r| (6 + 4 * r) as f32).sum::<f32>()
        );
    }
    let (background, plain_checkpoint) = (
        Checkpoint::latest(&root).unwrap().unwrap(),
        Checkpoint::latest(&plain).unwrap().unwrap(),
    );
    for name in ["w", "b", "m", "steps"] {
        assert_eq!(
            background.read_whole(name).unwrap(),
            plain_checkpoint.read_whole(name).unwrap(),
            "{name}"
        );
    }
    std::fs::remove_dir_all(root).unwrap();
    std::fs::remove_dir_all(plain).unwrap();
}

#[test]
fn pruning_keeps_the_newest_checkpoints_and_the_one_latest_names() {
    let root = scratch("prune");
    let b = Shard::whole("b", TensorData::new(vec![1.0f32, 2.0], [2]));
    let mut saver = BackgroundSaver::new(None).unwrap().keeping(Some(2));
    for step in 1..=5 {
        saver
            .start(&root, step, Ok(vec![b.clone()]), json!({}))
            .unwrap();
    }
    saver.wait().unwrap();
    let names = |root: &Path| {
        let mut names: Vec<String> = std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    assert_eq!(names(&root), ["latest", "step-00000004", "step-00000005"]);
    assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 5);
    // After a crash between a commit and `latest`, the step `latest` names is what loads, so
    // it stays whatever its age; a removal a crash cut short is finished.
    save(&root, 6, None, Ok(vec![b.clone()]), json!({})).unwrap();
    std::fs::write(root.join("latest"), "step-00000004\n").unwrap();
    std::fs::create_dir_all(root.join(".step-00000002.pruned")).unwrap();
    assert_eq!(burn_checkpoint::prune(&root, 2).unwrap(), [5]);
    assert_eq!(names(&root), ["latest", "step-00000004", "step-00000006"]);
    assert_eq!(
        burn_checkpoint::prune(&root, 0).unwrap(),
        [6],
        "at least one is kept"
    );
    assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 4);
    // Without `latest`, the newest committed step is what loads, and it stays; so does the
    // count. A copy a crash left set aside beside its replacement goes.
    save(&root, 7, None, Ok(vec![b.clone()]), json!({})).unwrap();
    save(&root, 8, None, Ok(vec![b.clone()]), json!({})).unwrap();
    std::fs::remove_file(root.join("latest")).unwrap();
    std::fs::create_dir_all(root.join(".step-00000007.replaced")).unwrap();
    assert_eq!(burn_checkpoint::prune(&root, 1).unwrap(), [4, 7]);
    assert_eq!(names(&root), ["step-00000008"]);
    assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 8);
    // Failing to remove the older ones does not fail the save: it is committed, and the
    // saver says why the others stayed.
    std::fs::write(
        root.join(".step-00000001.pruned"),
        b"a file, not a directory",
    )
    .unwrap();
    let mut saver = BackgroundSaver::new(None).unwrap().keeping(Some(1));
    saver
        .start(&root, 9, Ok(vec![b.clone()]), json!({}))
        .unwrap();
    let saved = saver.wait().unwrap().unwrap();
    assert_eq!(saved.step, 9);
    assert!(
        saved
            .prune_failed
            .is_some_and(|why| why.contains(".step-00000001.pruned")),
        "{:?}",
        saved.dir
    );
    assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 9);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_crash_leaves_the_last_committed_checkpoint_and_the_next_save_clears_it() {
    let root = scratch("crash");
    assert!(Checkpoint::latest(&root).unwrap().is_none());
    let b = Shard::whole("b", TensorData::new(vec![1.0f32, 2.0], [2]));
    save(&root, 1, None, Ok(vec![b.clone()]), json!({})).unwrap();
    // A save of step 2 that died while writing: its staging directory, half written.
    let partial = root.join(".step-00000002.partial");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("data-00000.bin"), b"half").unwrap();
    let latest = Checkpoint::latest(&root).unwrap().unwrap();
    assert_eq!(latest.step(), 1);
    assert_eq!(latest.read_whole("b").unwrap(), *b.data.read().unwrap());
    // The run resumes from step 1 and saves step 2 again, then step 2 once more.
    let b2 = Shard::whole("b", TensorData::new(vec![3.0f32, 4.0], [2]));
    save(&root, 2, None, Ok(vec![b.clone()]), json!({})).unwrap();
    save(&root, 2, None, Ok(vec![b2.clone()]), json!({})).unwrap();
    assert!(!partial.exists());
    let latest = Checkpoint::latest(&root).unwrap().unwrap();
    assert_eq!(latest.step(), 2);
    assert_eq!(latest.read_whole("b").unwrap(), *b2.data.read().unwrap());
    // A crash while step 2 was being replaced: the old copy set aside, the new one not yet in
    // place. The old copy is what loads.
    std::fs::rename(
        root.join("step-00000002"),
        root.join(".step-00000002.replaced"),
    )
    .unwrap();
    let latest = Checkpoint::latest(&root).unwrap().unwrap();
    assert_eq!(
        (latest.step(), latest.read_whole("b").unwrap()),
        (2, b2.data.read().unwrap().into_owned())
    );
    // Saving step 2 again puts it in place and clears the copy and a stale staging directory
    // of another step; `latest` is trusted over a newer directory it does not name.
    std::fs::create_dir_all(root.join(".step-00000007.partial")).unwrap();
    save(&root, 2, None, Ok(vec![b2.clone()]), json!({})).unwrap();
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(names, ["latest", "step-00000001", "step-00000002"]);
    std::fs::write(root.join("latest"), "step-00000001\n").unwrap();
    assert_eq!(Checkpoint::latest(&root).unwrap().unwrap().step(), 1);
    std::fs::remove_dir_all(root).unwrap();
}

fn message(result: Result<impl std::fmt::Debug, CheckpointError>) -> String {
    result.unwrap_err().to_string()
}

#[test]
fn a_damaged_checkpoint_is_refused_naming_the_file() {
    let root = scratch("damage");
    let dir = save_four(&root, 3).remove(0);
    let data = dir.join("data-00000.bin");
    let bytes = std::fs::read(&data).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    // One flipped bit in a piece: its checksum fails when any box of it is read.
    let mut flipped = bytes.clone();
    flipped[0] ^= 1;
    std::fs::write(&data, &flipped).unwrap();
    let errors: Vec<String> = ["w", "b", "m", "steps"]
        .iter()
        .filter_map(|name| checkpoint.read_whole(name).err().map(|e| e.to_string()))
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("data-00000.bin") && errors[0].contains("checksum"),
        "{errors:?}"
    );
    // Cut short: refused when opened.
    std::fs::write(&data, &bytes[..bytes.len() - 1]).unwrap();
    let error = message(Checkpoint::open(&dir));
    assert!(
        error.contains("data-00000.bin") && error.contains("is said to end"),
        "{error}"
    );
    std::fs::write(&data, &bytes).unwrap();
    // A manifest that is not one, or edited to leave a gap.
    let manifest = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, &text[..text.len() / 2]).unwrap();
    let error = message(Checkpoint::open(&dir));
    assert!(
        error.contains("manifest.json") && error.contains("not a checkpoint's manifest"),
        "{error}"
    );
    let mut edited: serde_json::Value = serde_json::from_str(&text).unwrap();
    edited["tensors"]["w"]["shards"]
        .as_array_mut()
        .unwrap()
        .pop();
    std::fs::write(&manifest, edited.to_string()).unwrap();
    let error = message(Checkpoint::open(&dir));
    assert!(error.contains("cover 24 of its 48"), "{error}");
    std::fs::write(&manifest, &text).unwrap();
    // Asking for what it does not hold.
    let checkpoint = Checkpoint::open(&dir).unwrap();
    assert!(message(checkpoint.read_whole("v")).contains("holds no tensor `v`"));
    let outside = Region::new(vec![6, 0], vec![4, 6]);
    assert!(message(checkpoint.read("w", &outside)).contains("has no box at [6, 0]"));
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn pieces_that_disagree_overlap_or_leave_a_gap_are_refused_on_every_rank() {
    let root = scratch("refused");
    /// What each rank hands in.
    type Pieces = fn(usize) -> Vec<Shard>;
    let cases: [(&str, Pieces); 3] = [
        ("is F32 [4, 4] on rank 0 but F32 [4, 5] on rank 1", |rank| {
            let shape = [4, 4 + rank];
            vec![piece("x", &shape, Region::whole(&shape))]
        }),
        ("overlap without being the same", |rank| {
            vec![piece(
                "x",
                &[4],
                Region::new(vec![rank * 2], vec![3 - rank]),
            )]
        }),
        ("cover 8 of its 12 elements", |rank| {
            vec![piece(
                "x",
                &[4, 3],
                Region::block(&[4, 3], 1, rank..rank + 1),
            )]
        }),
    ];
    // A rank that could not make its pieces: every rank fails with its reason.
    let results = launch(2, |ctx| {
        let pieces = match ctx.rank() {
            1 => Err("out of host memory".to_string()),
            _ => Ok(vec![piece("x", &[4], Region::whole(&[4]))]),
        };
        save(&root, 1, Some(ctx.world()), pieces, json!({}))
    });
    for result in results {
        let error = result.unwrap_err().to_string();
        assert!(error.contains("rank 1: out of host memory"), "{error}");
    }
    for (expected, pieces) in cases {
        let results = launch(2, |ctx| {
            save(
                &root,
                1,
                Some(ctx.world()),
                Ok(pieces(ctx.rank())),
                json!({}),
            )
        });
        for result in results {
            let error = result.unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
        }
        assert!(
            Checkpoint::latest(&root).unwrap().is_none(),
            "nothing is committed"
        );
    }
}
