//! Reading a checkpoint: the newest committed one under a directory, or one step's; then any
//! box of any tensor, assembled from the pieces that overlap it, each checked against its
//! checksum. A damaged checkpoint is refused naming the file; nothing partial is returned.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};

use crate::error::CheckpointError;
use crate::manifest::{FORMAT, MANIFEST, Manifest, ShardEntry, TensorEntry, dtype_of};
use crate::region::{Region, copy_part};
use crate::save::LATEST;

/// A committed checkpoint, opened.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    dir: PathBuf,
    manifest: Manifest,
}

impl Checkpoint {
    /// The checkpoint `root`'s `latest` names, or none when there is none yet. Where `latest`
    /// is missing or names a checkpoint that is not there (a crash between a commit and its
    /// move), the newest committed one by step: a `step-N` directory only ever appears whole,
    /// and a `.step-N.replaced` one is whole too when its replacement was not yet put in place.
    pub fn latest(root: &Path) -> Result<Option<Self>, CheckpointError> {
        let named = std::fs::read_to_string(root.join(LATEST)).ok();
        let named = named.map(|n| root.join(n.trim()));
        if let Some(dir) = named.filter(|d| d.join(MANIFEST).exists()) {
            return Self::open(&dir).map(Some);
        }
        let entries = match std::fs::read_dir(root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(CheckpointError::io(root)(e)),
        };
        let names: Vec<String> = entries
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .collect();
        let newest = names
            .iter()
            .filter_map(|name| {
                let committed = name.strip_prefix("step-");
                let aside = name
                    .strip_prefix(".step-")
                    .and_then(|n| n.strip_suffix(".replaced"))
                    .filter(|n| !names.contains(&format!("step-{n}")));
                let step: u64 = committed.or(aside)?.parse().ok()?;
                Some((step, root.join(name)))
            })
            .filter(|(_, dir)| dir.join(MANIFEST).exists())
            .max_by_key(|(step, _)| *step);
        newest.map(|(_, dir)| Self::open(&dir)).transpose()
    }

    /// The checkpoint in `dir`: its manifest read and checked against its files' lengths.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read(&path).map_err(CheckpointError::io(&path))?;
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.clone(),
            reason,
        };
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| corrupt(format!("not a checkpoint's manifest ({e})")))?;
        if manifest.format != FORMAT {
            return Err(corrupt(format!(
                "written in the format {:?}, and this reads {FORMAT:?}",
                manifest.format
            )));
        }
        let named = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let step = format!("step-{:08}", manifest.step);
        if named != step && named != format!(".{step}.replaced") {
            return Err(corrupt(format!(
                "records step {}, not that of its directory",
                manifest.step
            )));
        }
        for (name, tensor) in &manifest.tensors {
            check_entry(name, tensor).map_err(corrupt)?;
            for shard in &tensor.shards {
                let file = dir.join(&shard.file);
                if !is_data_file(&shard.file) {
                    return Err(corrupt(format!(
                        "`{name}` lies in {:?}, which is not one of its data files",
                        shard.file
                    )));
                }
                let len = std::fs::metadata(&file)
                    .map_err(CheckpointError::io(&file))?
                    .len();
                if shard
                    .offset
                    .checked_add(shard.bytes)
                    .is_none_or(|end| end > len)
                {
                    return Err(CheckpointError::Corrupt {
                        path: file,
                        reason: format!(
                            "{len} bytes, but a piece of `{name}` is said to end at byte {}",
                            shard.offset + shard.bytes
                        ),
                    });
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The step it was taken after.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// Ranks that saved it.
    pub fn world(&self) -> usize {
        self.manifest.world
    }

    /// What the application kept with it.
    pub fn metadata(&self) -> &serde_json::Value {
        &self.manifest.metadata
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.manifest.tensors.keys().map(String::as_str)
    }

    /// The whole shape of `name`, if the checkpoint holds it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.manifest.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// `name` whole.
    pub fn read_whole(&self, name: &str) -> Result<TensorData, CheckpointError> {
        let shape = self.entry(name)?.shape.clone();
        self.read(name, &Region::whole(&shape))
    }

    /// The box `region` of `name`, in its stored dtype, from whichever pieces hold it.
    pub fn read(&self, name: &str, region: &Region) -> Result<TensorData, CheckpointError> {
        let tensor = self.entry(name)?;
        if !region.is_within(&tensor.shape) {
            return Err(CheckpointError::Mismatch(format!(
                "`{name}` is shaped {:?}: it has no box at {:?} reaching {:?}",
                tensor.shape, region.offsets, region.extents
            )));
        }
        let dtype = dtype_of(&tensor.dtype).expect("checked when opened");
        // The pieces tile the tensor, so a piece that is the box is the only one overlapping it
        // (a resume in the layout that saved): it is read straight into place.
        if let Some(shard) = tensor.shards.iter().find(|s| &s.region == region) {
            let bytes = self.read_piece(name, shard)?;
            return Ok(TensorData::from_bytes_vec(
                bytes,
                region.extents.clone(),
                dtype,
            ));
        }
        let size = dtype.size();
        let mut out = vec![0u8; region.volume() * size];
        for shard in &tensor.shards {
            let Some(part) = shard.region.intersect(region) else {
                continue;
            };
            let bytes = self.read_piece(name, shard)?;
            copy_part(&bytes, &shard.region, &mut out, region, &part, size);
        }
        Ok(TensorData::from_bytes_vec(
            out,
            region.extents.clone(),
            dtype,
        ))
    }

    /// The bytes of one piece of `name`, checked against its checksum.
    fn read_piece(&self, name: &str, shard: &ShardEntry) -> Result<Vec<u8>, CheckpointError> {
        let path = self.dir.join(&shard.file);
        let mut bytes = vec![0u8; shard.bytes as usize];
        File::open(&path)
            .and_then(|mut file| {
                file.seek(SeekFrom::Start(shard.offset))?;
                file.read_exact(&mut bytes)
            })
            .map_err(CheckpointError::io(&path))?;
        if crc32fast::hash(&bytes) != shard.crc32 {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!(
                    "the piece of `{name}` at {:?} does not match its checksum",
                    shard.region.offsets
                ),
            });
        }
        Ok(bytes)
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, CheckpointError> {
        self.manifest.tensors.get(name).ok_or_else(|| {
            CheckpointError::Mismatch(format!(
                "the checkpoint in {} holds no tensor `{name}`",
                self.dir.display()
            ))
        })
    }
}

/// Whether `name` is a data file's name as `save` writes them: `data-RRRRR.bin`.
fn is_data_file(name: &str) -> bool {
    name.strip_prefix("data-")
        .and_then(|n| n.strip_suffix(".bin"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A tensor's entry tiles it: a known dtype, pieces inside it whose sizes fit their boxes, not
/// overlapping, covering it.
fn check_entry(name: &str, tensor: &TensorEntry) -> Result<(), String> {
    let dtype: DType = dtype_of(&tensor.dtype)
        .ok_or_else(|| format!("`{name}` has the unknown dtype {:?}", tensor.dtype))?;
    let volume = |extents: &[usize]| extents.iter().try_fold(1usize, |n, &e| n.checked_mul(e));
    let mut covered = 0usize;
    for (i, shard) in tensor.shards.iter().enumerate() {
        let region = &shard.region;
        let inside = region.offsets.len() == region.extents.len()
            && region.offsets.len() == tensor.shape.len()
            && (0..tensor.shape.len()).all(|d| {
                region.offsets[d]
                    .checked_add(region.extents[d])
                    .is_some_and(|end| end <= tensor.shape[d])
            });
        let bytes = volume(&region.extents).and_then(|v| v.checked_mul(dtype.size()));
        if !inside || bytes != Some(shard.bytes as usize) {
            return Err(format!("a piece of `{name}` does not fit it"));
        }
        if tensor.shards[i + 1..]
            .iter()
            .any(|other| other.region.intersect(&shard.region).is_some())
        {
            return Err(format!("two pieces of `{name}` overlap"));
        }
        covered += shard.region.volume();
    }
    let whole = volume(&tensor.shape).ok_or_else(|| format!("`{name}`'s shape overflows"))?;
    if covered != whole {
        return Err(format!(
            "the pieces of `{name}` cover {covered} of its {whole} elements"
        ));
    }
    Ok(())
}
