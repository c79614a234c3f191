//! The collective save. Every rank hands in the pieces it holds; they agree on who writes each
//! distinct piece (one writer per piece, the bytes spread over the ranks), write their files
//! into a staging directory, flush them, and rank 0 then writes the manifest, renames the
//! staging directory to the step's name (the commit: a directory appears whole or not at all)
//! and points `latest` at it. A crash at any moment leaves every earlier checkpoint as it was;
//! staging directories left behind are never read and are cleared by the next save. A
//! checkpoint of the same step is replaced by moving it aside first (`.step-N.replaced`), which
//! the loader still takes should a crash come before the new one is in place.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn_comm::Communicator;
use serde::{Deserialize, Serialize};

use crate::error::CheckpointError;
use crate::manifest::{FORMAT, MANIFEST, Manifest, ShardEntry, TensorEntry, dtype_name, dtype_of};
use crate::region::Region;
use crate::shard::Shard;

/// The file in a checkpoints' directory naming the newest committed checkpoint.
pub const LATEST: &str = "latest";

/// The name of step `step`'s checkpoint directory.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// What a rank tells the others of one piece it holds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
struct Piece {
    name: String,
    region: Region,
    shape: Vec<usize>,
    dtype: String,
}

/// Saves the pieces every rank of `comm` hands in (this process alone without one) as step
/// `step`'s checkpoint under `root`, with `metadata`, and returns its directory. A collective:
/// every rank calls it with the same `root`, `step` and `metadata`; pieces several ranks hold
/// alike are written once. Fails, on every rank, when the pieces do not tile their tensors or
/// disagree on a tensor's shape or dtype. A rank that could not make its pieces hands in why
/// (`Err`), so that every rank fails with it rather than wait for it.
pub fn save(
    root: &Path,
    step: u64,
    comm: Option<&Communicator>,
    shards: Result<Vec<Shard>, String>,
    metadata: serde_json::Value,
) -> Result<PathBuf, CheckpointError> {
    let (rank, world) = comm.map_or((0, 1), |c| (c.rank(), c.size()));
    let (shards, mine) = match shards {
        Ok(shards) => {
            let mine = describe(&shards).map_err(|e| e.to_string());
            (shards, mine)
        }
        Err(why) => (Vec::new(), Err(why)),
    };
    // Every rank learns every rank's pieces, or why one has none.
    let all: Vec<Result<Vec<Piece>, String>> = share(comm, &mine)?;
    let mut pieces = Vec::with_capacity(world);
    for (r, result) in all.into_iter().enumerate() {
        pieces.push(result.map_err(|e| CheckpointError::Mismatch(format!("rank {r}: {e}")))?);
    }
    let tensors = check_tiling(&pieces)?;
    let writers = assign_writers(&pieces);

    let staging = root.join(format!(".{}.partial", step_dir_name(step)));
    let prepared = (rank == 0)
        .then(|| prepare_staging(root, &staging))
        .transpose()
        .map_err(|e| e.to_string());
    agree(comm, prepared.map(drop))?;

    let written = write_mine(&staging, rank, &shards, &writers).map_err(|e| e.to_string());
    let entries: Vec<Result<Vec<(Piece, ShardEntry)>, String>> = share(comm, &written)?;
    let mut by_piece = BTreeMap::new();
    for (r, result) in entries.into_iter().enumerate() {
        let result = result.map_err(|e| {
            CheckpointError::Mismatch(format!("rank {r} could not write its part: {e}"))
        })?;
        by_piece.extend(result);
    }
    let committed = (rank == 0).then(|| {
        let manifest = Manifest {
            format: FORMAT.into(),
            step,
            world,
            tensors: tensors
                .into_iter()
                .map(|(name, (shape, dtype))| {
                    let shards = by_piece
                        .iter()
                        .filter(|(piece, _)| piece.name == name)
                        .map(|(_, entry)| entry.clone())
                        .collect();
                    (
                        name,
                        TensorEntry {
                            shape,
                            dtype,
                            shards,
                        },
                    )
                })
                .collect(),
            metadata,
        };
        commit(root, &staging, step, &manifest)
    });
    let committed = committed.transpose().map_err(|e| e.to_string());
    agree(comm, committed.map(drop))?;
    Ok(root.join(step_dir_name(step)))
}

/// This rank's pieces, checked: inside their tensors, shaped as their boxes, of a dtype a
/// checkpoint holds, none twice.
fn describe(shards: &[Shard]) -> Result<Vec<Piece>, CheckpointError> {
    let mut pieces = Vec::with_capacity(shards.len());
    for shard in shards {
        let dtype = dtype_name(shard.data.dtype()).ok_or_else(|| {
            CheckpointError::Mismatch(format!(
                "`{}` is {:?}, which a checkpoint does not hold; dequantize it first",
                shard.name,
                shard.data.dtype()
            ))
        })?;
        if !shard.region.is_within(&shard.shape) || shard.data.shape() != shard.region.extents {
            return Err(CheckpointError::Mismatch(format!(
                "the piece of `{}` at {:?} holds data shaped {:?}, not its box's {:?} inside {:?}",
                shard.name,
                shard.region.offsets,
                shard.data.shape(),
                shard.region.extents,
                shard.shape
            )));
        }
        pieces.push(Piece {
            name: shard.name.clone(),
            region: shard.region.clone(),
            shape: shard.shape.clone(),
            dtype: dtype.into(),
        });
    }
    let mut sorted = pieces.clone();
    sorted.sort();
    if let Some(twice) = sorted
        .windows(2)
        .find(|w| w[0].name == w[1].name && w[0].region == w[1].region)
    {
        return Err(CheckpointError::Mismatch(format!(
            "the piece of `{}` at {:?} is handed in twice",
            twice[0].name, twice[0].region.offsets
        )));
    }
    Ok(pieces)
}

/// Every tensor's shape and dtype, once every rank's pieces are seen to agree on them and to
/// tile it: distinct boxes never overlap, and together they cover it.
fn check_tiling(
    pieces: &[Vec<Piece>],
) -> Result<BTreeMap<String, (Vec<usize>, String)>, CheckpointError> {
    let mut tensors: BTreeMap<String, (Vec<usize>, String, usize, Vec<Region>)> = BTreeMap::new();
    for (rank, mine) in pieces.iter().enumerate() {
        for piece in mine {
            let entry = tensors
                .entry(piece.name.clone())
                .or_insert_with(|| (piece.shape.clone(), piece.dtype.clone(), rank, Vec::new()));
            if (&entry.0, &entry.1) != (&piece.shape, &piece.dtype) {
                return Err(CheckpointError::Mismatch(format!(
                    "`{}` is {} {:?} on rank {} but {} {:?} on rank {rank}",
                    piece.name, entry.1, entry.0, entry.2, piece.dtype, piece.shape
                )));
            }
            if !entry.3.contains(&piece.region) {
                entry.3.push(piece.region.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    for (name, (shape, dtype, _, regions)) in tensors {
        for (i, a) in regions.iter().enumerate() {
            if let Some(b) = regions[i + 1..].iter().find(|b| a.intersect(b).is_some()) {
                return Err(CheckpointError::Mismatch(format!(
                    "`{name}`: the pieces at {:?} and {:?} overlap without being the same",
                    a.offsets, b.offsets
                )));
            }
        }
        let covered: usize = regions.iter().map(Region::volume).sum();
        let whole: usize = shape.iter().product();
        if covered != whole {
            return Err(CheckpointError::Mismatch(format!(
                "`{name}`: the ranks' pieces cover {covered} of its {whole} elements"
            )));
        }
        out.insert(name, (shape, dtype));
    }
    Ok(out)
}

/// Who writes each distinct piece: of the ranks holding it, the one with the fewest bytes to
/// write so far (the lowest on a tie). Every rank computes the same from the same pieces.
fn assign_writers(pieces: &[Vec<Piece>]) -> BTreeMap<Piece, usize> {
    let mut holders: BTreeMap<&Piece, Vec<usize>> = BTreeMap::new();
    for (rank, mine) in pieces.iter().enumerate() {
        for piece in mine {
            holders.entry(piece).or_default().push(rank);
        }
    }
    let mut load = vec![0usize; pieces.len()];
    let mut writers = BTreeMap::new();
    // Largest first, so the spread comes out even.
    let mut order: Vec<(&Piece, Vec<usize>)> = holders.into_iter().collect();
    let bytes = |piece: &Piece| {
        let size = dtype_of(&piece.dtype).map_or(1, |d| d.size());
        piece.region.volume() * size
    };
    order.sort_by_key(|(piece, _)| std::cmp::Reverse(bytes(piece)));
    for (piece, ranks) in order {
        let writer = *ranks
            .iter()
            .min_by_key(|&&r| (load[r], r))
            .expect("a holder");
        load[writer] += bytes(piece);
        writers.insert(piece.clone(), writer);
    }
    writers
}

/// Clears the staging directories crashed saves left (of any step), and makes this one.
fn prepare_staging(root: &Path, staging: &Path) -> Result<(), CheckpointError> {
    fs::create_dir_all(root).map_err(CheckpointError::io(root))?;
    let entries = fs::read_dir(root).map_err(CheckpointError::io(root))?;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step-") && name.ends_with(".partial") {
            let stale = entry.path();
            fs::remove_dir_all(&stale).map_err(CheckpointError::io(&stale))?;
        }
    }
    fs::create_dir(staging).map_err(CheckpointError::io(staging))
}

/// This rank's file in `staging`: the pieces it writes, end to end, flushed to disk; and
/// where each one is.
fn write_mine(
    staging: &Path,
    rank: usize,
    shards: &[Shard],
    writers: &BTreeMap<Piece, usize>,
) -> Result<Vec<(Piece, ShardEntry)>, CheckpointError> {
    let file_name = format!("data-{rank:05}.bin");
    let path = staging.join(&file_name);
    let mut entries = Vec::new();
    let mut file: Option<std::io::BufWriter<File>> = None;
    let mut offset = 0u64;
    for shard in shards {
        let piece = Piece {
            name: shard.name.clone(),
            region: shard.region.clone(),
            shape: shard.shape.clone(),
            dtype: dtype_name(shard.data.dtype()).expect("checked").into(),
        };
        if writers.get(&piece) != Some(&rank) {
            continue;
        }
        let out = match &mut file {
            Some(out) => out,
            None => file.insert(std::io::BufWriter::new(
                File::create(&path).map_err(CheckpointError::io(&path))?,
            )),
        };
        // A piece that cannot be read fails this rank's part, which every rank then reports.
        let data = shard.data.read().map_err(|e| {
            CheckpointError::Mismatch(format!("`{}` could not be read: {e}", shard.name))
        })?;
        let bytes = data.as_bytes();
        out.write_all(bytes).map_err(CheckpointError::io(&path))?;
        let entry = ShardEntry {
            region: shard.region.clone(),
            file: file_name.clone(),
            offset,
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
        };
        offset += bytes.len() as u64;
        entries.push((piece, entry));
    }
    if let Some(out) = file {
        let out = out.into_inner().map_err(|e| CheckpointError::Io {
            path: path.clone(),
            source: e.into_error(),
        })?;
        out.sync_all().map_err(CheckpointError::io(&path))?;
    }
    Ok(entries)
}

/// Rank 0's commit: the manifest, flushed; the staging directory renamed to the step's (an
/// earlier checkpoint of the same step replaced); then `latest`.
fn commit(
    root: &Path,
    staging: &Path,
    step: u64,
    manifest: &Manifest,
) -> Result<(), CheckpointError> {
    let text = serde_json::to_vec_pretty(manifest).expect("a manifest serializes");
    write_durably(&staging.join(MANIFEST), &text)?;
    sync_dir(staging)?;
    let name = step_dir_name(step);
    let target = root.join(&name);
    let aside = root.join(format!(".{name}.replaced"));
    if target.exists() {
        // The step's checkpoint is whole, so an older copy set aside is not needed.
        if aside.exists() {
            fs::remove_dir_all(&aside).map_err(CheckpointError::io(&aside))?;
        }
        fs::rename(&target, &aside).map_err(CheckpointError::io(&target))?;
        sync_dir(root)?;
    }
    fs::rename(staging, &target).map_err(CheckpointError::io(&target))?;
    sync_dir(root)?;
    write_durably(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    sync_dir(root)?;
    // Committed: a copy set aside may go, and failing to remove it loses nothing.
    let _ = fs::remove_dir_all(&aside);
    Ok(())
}

/// Removes the committed checkpoints under `root` but the `keep` newest (at least one),
/// never the one [`Checkpoint::latest`](crate::Checkpoint::latest) would load, and returns
/// their steps; a process alone, or rank 0, calls it after a save. Each goes by a rename first
/// (`.step-N.pruned`), so a crash never leaves a half-removed `step-N` for a load to find;
/// leftovers of such a crash go too, as do copies set aside by a replaced save that a crash
/// kept (`.step-N.replaced` beside its `step-N`). Fails, removing nothing, when the
/// checkpoint to load cannot be told.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<u64>, CheckpointError> {
    let loaded = crate::Checkpoint::latest(root)?.map(|c| c.dir().to_path_buf());
    let entries = fs::read_dir(root).map_err(CheckpointError::io(root))?;
    let mut steps = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        let replaced = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".replaced"))
            .filter(|n| root.join(n).exists());
        if (name.starts_with(".step-") && name.ends_with(".pruned")) || replaced.is_some() {
            if Some(&path) != loaded.as_ref() {
                fs::remove_dir_all(&path).map_err(CheckpointError::io(&path))?;
            }
        } else if let Some(step) = name
            .strip_prefix("step-")
            .and_then(|s| s.parse::<u64>().ok())
            && Some(&path) != loaded.as_ref()
        {
            steps.push((step, path));
        }
    }
    steps.sort_unstable();
    // The one to load counts as one of `keep`, where it is a committed step.
    let loads_a_step = loaded.as_ref().is_some_and(|dir| {
        dir.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
    });
    let others = keep.max(1) - usize::from(loads_a_step);
    let gone = &steps[..steps.len().saturating_sub(others)];
    for (_, dir) in gone {
        let name = dir
            .file_name()
            .expect("a directory's name")
            .to_string_lossy();
        let aside = root.join(format!(".{name}.pruned"));
        fs::rename(dir, &aside).map_err(CheckpointError::io(dir))?;
        sync_dir(root)?;
        fs::remove_dir_all(&aside).map_err(CheckpointError::io(&aside))?;
    }
    Ok(gone.iter().map(|(step, _)| *step).collect())
}

/// Writes `path` through a temporary file renamed over it, flushed first.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let temporary = path.with_extension("tmp");
    let mut file = File::create(&temporary).map_err(CheckpointError::io(&temporary))?;
    file.write_all(bytes)
        .map_err(CheckpointError::io(&temporary))?;
    file.sync_all().map_err(CheckpointError::io(&temporary))?;
    fs::rename(&temporary, path).map_err(CheckpointError::io(path))
}

/// Flushes a directory's entries (a rename is durable once its directory is).
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io(dir))
}

/// Every rank's `value`, in rank order (this process's alone without a communicator).
fn share<T: Serialize + for<'de> Deserialize<'de>>(
    comm: Option<&Communicator>,
    value: &T,
) -> Result<Vec<T>, CheckpointError> {
    let bytes = serde_json::to_vec(value).expect("a value serializes");
    gather_bytes(comm, bytes)?
        .iter()
        .map(|b| {
            serde_json::from_slice(b).map_err(|e| {
                CheckpointError::Mismatch(format!(
                    "a rank sent what is not a checkpoint's message: {e}"
                ))
            })
        })
        .collect()
}

/// Fails on every rank if `outcome` failed on any, naming the first rank that failed.
fn agree(comm: Option<&Communicator>, outcome: Result<(), String>) -> Result<(), CheckpointError> {
    for (rank, result) in share(comm, &outcome)?.into_iter().enumerate() {
        result.map_err(|e| CheckpointError::Mismatch(format!("rank {rank}: {e}")))?;
    }
    Ok(())
}

/// Every rank's bytes, in rank order (this process's alone without a communicator).
fn gather_bytes(
    comm: Option<&Communicator>,
    bytes: Vec<u8>,
) -> Result<Vec<Vec<u8>>, CheckpointError> {
    match comm {
        Some(comm) => Ok(comm.all_gather_bytes(&bytes)?),
        None => Ok(vec![bytes]),
    }
}
