//! A checkpoint's tensors in safetensors files as transformers lays them out: one
//! `model.safetensors`, or, above a size limit, shards `model-0000N-of-0000M.safetensors` and
//! `model.safetensors.index.json` mapping each tensor to its shard.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, TensorData};
use safetensors::tensor::{Dtype, Metadata, TensorView};
use serde_json::{Value, json};

/// The single file of an unsharded checkpoint.
pub const SINGLE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";
/// transformers 4's default shard limit (`max_shard_size="5GB"`, decimal gigabytes; 5 writes
/// 50GB shards), which both read.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Writes `tensors` (f32, f16 or bf16, each as given) into `dir`: one file if they fit in `max_shard_bytes`, else shards
/// filled in order, each closed before the next tensor would take it past the limit (a
/// tensor larger than the limit gets a shard of its own), and the index. Files of an earlier
/// save in another layout are removed first, so a reader never sees both.
pub fn write(
    dir: &Path,
    tensors: &[(String, TensorData)],
    max_shard_bytes: u64,
) -> Result<(), String> {
    remove_earlier(dir)?;
    let mut shards: Vec<Vec<&(String, TensorData)>> = vec![Vec::new()];
    let mut filled = 0u64;
    for tensor in tensors {
        let bytes = tensor.1.as_bytes().len() as u64;
        let current = shards.last_mut().expect("one shard at least");
        if !current.is_empty() && filled + bytes > max_shard_bytes {
            shards.push(Vec::new());
            filled = 0;
        }
        shards.last_mut().expect("one shard at least").push(tensor);
        filled += bytes;
    }
    if shards.len() == 1 {
        return write_file(&dir.join(SINGLE), &shards[0]);
    }
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = shard_name(i + 1, count);
        write_file(&dir.join(&name), shard)?;
        for (tensor, _) in shard {
            weight_map.insert(tensor.clone(), json!(name));
        }
    }
    let total: usize = tensors.iter().map(|(_, data)| data.as_bytes().len()).sum();
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let text = serde_json::to_string_pretty(&index).expect("a JSON value prints");
    std::fs::write(dir.join(INDEX), text)
        .map_err(|e| format!("cannot write {}: {e}", dir.join(INDEX).display()))
}

/// Every tensor of the checkpoint in `dir`, in its stored dtype (see [`Checkpoint::open`]).
pub fn read(dir: &Path) -> Result<HashMap<String, TensorData>, String> {
    Checkpoint::open(dir)?.read_all()
}

/// Every tensor of one safetensors file, in its stored dtype (f32, f16 or bf16).
pub fn read_file(path: &Path) -> Result<HashMap<String, TensorData>, String> {
    Checkpoint::open_file(path)?.read_all()
}

/// A checkpoint opened by reading its files' headers only: a tensor, or a range of it along one
/// dimension, is read when asked for, so a rank reads only the slices it holds.
pub struct Checkpoint {
    files: Vec<PathBuf>,
    tensors: HashMap<String, Stored>,
    bytes_read: AtomicU64,
}

/// Where one tensor lies in its file.
struct Stored {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Its first byte in the file.
    start: u64,
}

impl Checkpoint {
    /// The checkpoint in `dir`: the index and its shards when there is an index, else the
    /// single file. Both at once are refused, since transformers would read the single file and
    /// might not read the same weights; an index naming a tensor its shard lacks, or a shard
    /// holding a tensor its index does not list, too.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let index = dir.join(INDEX);
        if !index.exists() {
            if !dir.join(SINGLE).exists() {
                return Err(format!(
                    "{} holds no safetensors checkpoint: neither {SINGLE} nor {INDEX} with its shards",
                    dir.display()
                ));
            }
            return Self::open_file(&dir.join(SINGLE));
        }
        if dir.join(SINGLE).exists() {
            return Err(format!(
                "{} holds both {SINGLE} and {INDEX}, which transformers would not read alike; remove the one that is stale",
                dir.display()
            ));
        }
        let text = std::fs::read_to_string(&index)
            .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", index.display()))?;
        let weight_map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| format!("{} has no weight_map", index.display()))?;
        let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, shard) in weight_map {
            let shard = shard.as_str().ok_or_else(|| {
                format!(
                    "{} maps `{tensor}` to {shard}, not a file name",
                    index.display()
                )
            })?;
            if shard.contains(['/', '\\']) {
                return Err(format!(
                    "{} maps `{tensor}` to {shard}, outside the checkpoint's directory",
                    index.display()
                ));
            }
            by_shard.entry(shard).or_default().push(tensor);
        }
        let mut checkpoint = Self::empty();
        for (shard, names) in by_shard {
            let mut stored = checkpoint.add_file(&dir.join(shard))?;
            for name in names {
                let tensor = stored.remove(name).ok_or_else(|| {
                    format!(
                        "{} says `{name}` is in {shard}, but it is not",
                        index.display()
                    )
                })?;
                checkpoint.tensors.insert(name.to_string(), tensor);
            }
            if let Some(name) = stored.keys().min() {
                return Err(format!(
                    "{shard} holds `{name}`, which {} does not list; a reader that loads whole shards would see it, so remove it or list it",
                    index.display()
                ));
            }
        }
        Ok(checkpoint)
    }

    /// One safetensors file as a checkpoint.
    pub fn open_file(path: &Path) -> Result<Self, String> {
        let mut checkpoint = Self::empty();
        checkpoint.tensors = checkpoint.add_file(path)?;
        Ok(checkpoint)
    }

    fn empty() -> Self {
        Self {
            files: Vec::new(),
            tensors: HashMap::new(),
            bytes_read: AtomicU64::new(0),
        }
    }

    /// Reads `path`'s header and returns where its tensors lie.
    fn add_file(&mut self, path: &Path) -> Result<HashMap<String, Stored>, String> {
        let header = Header::read(path)?;
        let file = self.files.len();
        self.files.push(path.to_path_buf());
        header
            .metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let dtype = DTYPES
                    .iter()
                    .find(|(_, stored)| *stored == info.dtype)
                    .map(|(dtype, _)| *dtype)
                    .ok_or_else(|| {
                        format!(
                            "{}: `{name}` is {:?}; only f32, f16 and bf16 load",
                            path.display(),
                            info.dtype
                        )
                    })?;
                let stored = Stored {
                    file,
                    dtype,
                    shape: info.shape.clone(),
                    start: header.data_start + info.data_offsets.0 as u64,
                };
                Ok((name, stored))
            })
            .collect()
    }

    /// The names of its tensors, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// The stored shape of `name`, if the checkpoint holds it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// Bytes of tensor data read so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// Every tensor, whole, in its stored dtype.
    pub fn read_all(&self) -> Result<HashMap<String, TensorData>, String> {
        self.tensors
            .keys()
            .map(|name| Ok((name.clone(), self.read(name)?)))
            .collect()
    }

    /// `name` whole, in its stored dtype.
    pub fn read(&self, name: &str) -> Result<TensorData, String> {
        let len = self.stored(name)?.shape.first().copied().unwrap_or(1);
        self.read_block(name, 0, 0..len)
    }

    /// The elements `range` along `dim` of `name` (every index of the other dimensions), in
    /// its stored dtype: one read when they are contiguous, one per outer index otherwise.
    pub fn read_block(
        &self,
        name: &str,
        dim: usize,
        range: Range<usize>,
    ) -> Result<TensorData, String> {
        let stored = self.stored(name)?;
        let shape = if stored.shape.is_empty() {
            vec![1]
        } else {
            stored.shape.clone()
        };
        if dim >= shape.len() || range.start > range.end || range.end > shape[dim] {
            return Err(format!(
                "`{name}` is shaped {shape:?}: it has no elements {range:?} along dimension {dim}"
            ));
        }
        let size = stored.dtype.size();
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product::<usize>() * size;
        // Whole rows of the outer dimensions follow each other when the range covers `dim`.
        let (outer, run, stride) = if range.len() == shape[dim] {
            (1, outer * shape[dim] * inner, 0)
        } else {
            (outer, range.len() * inner, shape[dim] * inner)
        };
        let path = &self.files[stored.file];
        let failed =
            |e: std::io::Error| format!("cannot read `{name}` from {}: {e}", path.display());
        let mut file = File::open(path).map_err(failed)?;
        let mut bytes = vec![0u8; outer * run];
        for (o, chunk) in bytes.chunks_exact_mut(run.max(1)).enumerate() {
            let at = stored.start + (o * stride + range.start * inner) as u64;
            file.seek(SeekFrom::Start(at)).map_err(failed)?;
            file.read_exact(chunk).map_err(failed)?;
        }
        self.bytes_read
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let mut block = shape;
        block[dim] = range.len();
        if stored.shape.is_empty() {
            block.clear();
        }
        Ok(TensorData::from_bytes_vec(bytes, block, stored.dtype))
    }

    fn stored(&self, name: &str) -> Result<&Stored, String> {
        self.tensors
            .get(name)
            .ok_or_else(|| format!("the checkpoint has no tensor `{name}`"))
    }
}

/// A safetensors file's header, checked against the file's length.
struct Header {
    metadata: Metadata,
    /// Where the tensors' data starts.
    data_start: u64,
}

impl Header {
    /// safetensors' own bound on a header.
    const MAX_BYTES: u64 = 100_000_000;

    fn read(path: &Path) -> Result<Self, String> {
        let failed = |e: std::io::Error| format!("cannot read {}: {e}", path.display());
        let mut file = File::open(path).map_err(failed)?;
        let len = file.metadata().map_err(failed)?.len();
        let not = |why: String| format!("{} is not a safetensors file: {why}", path.display());
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|_| not(format!("{len} bytes, shorter than a header")))?;
        let n = u64::from_le_bytes(n);
        if n > Self::MAX_BYTES || 8 + n > len {
            return Err(not(format!("a header of {n} bytes in a file of {len}")));
        }
        let mut text = vec![0u8; n as usize];
        file.read_exact(&mut text).map_err(failed)?;
        let metadata: Metadata =
            serde_json::from_slice(&text).map_err(|e| not(format!("its header: {e}")))?;
        let data = metadata
            .tensors()
            .values()
            .map(|info| info.data_offsets.1 as u64)
            .max()
            .unwrap_or(0);
        if 8 + n + data != len {
            return Err(format!(
                "{} is truncated or has bytes after its tensors: its header describes {data} bytes of tensor data, the file holds {}",
                path.display(),
                len - 8 - n
            ));
        }
        Ok(Self {
            metadata,
            data_start: 8 + n,
        })
    }
}

/// The element types read and written, as burn and safetensors name them.
const DTYPES: [(DType, Dtype); 3] = [
    (DType::F32, Dtype::F32),
    (DType::F16, Dtype::F16),
    (DType::BF16, Dtype::BF16),
];

/// `model-0000i-of-0000n.safetensors`, transformers' shard name.
fn shard_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}

/// One safetensors file.
fn write_file(path: &Path, tensors: &[&(String, TensorData)]) -> Result<(), String> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            let dtype = DTYPES
                .iter()
                .find(|(dtype, _)| *dtype == data.dtype)
                .map(|(_, stored)| *stored)
                .ok_or_else(|| {
                    format!(
                        "`{name}` is {:?}; only f32, f16 and bf16 are written",
                        data.dtype
                    )
                })?;
            let view = TensorView::new(dtype, data.shape.to_vec(), data.as_bytes())
                .map_err(|e| format!("`{name}`: {e}"))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, String>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Removes the single file, the index and the shards a save may have left in `dir`.
fn remove_earlier(dir: &Path) -> Result<(), String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let earlier: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name == SINGLE || name == INDEX || is_shard_name(name)
        })
        .collect();
    for path in earlier {
        std::fs::remove_file(&path)
            .map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Whether `name` is `model-NNNNN-of-NNNNN.safetensors`.
fn is_shard_name(name: &str) -> bool {
    let Some(middle) = name
        .strip_prefix("model-")
        .and_then(|rest| rest.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    matches!(middle.split_once("-of-"), Some((i, n)) if digits(i) && digits(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, values: Vec<f32>) -> (String, TensorData) {
        let n = values.len();
        (name.into(), TensorData::new(values, [n]))
    }

    #[test]
    fn shards_fill_in_order_and_read_back_through_the_index() {
        let dir = std::env::temp_dir().join(format!("llama-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tensors = vec![
            tensor("a", vec![1.0; 3]),
            tensor("b", vec![2.0; 2]),
            tensor("big", vec![3.0; 9]),
            tensor("c", vec![4.0; 1]),
        ];
        // 24 bytes a shard: a + b fill the first (20), big gets its own (36), c the last.
        write(&dir, &tensors, 24).unwrap();
        assert!(!dir.join(SINGLE).exists());
        let index: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX)).unwrap()).unwrap();
        assert_eq!(index["metadata"]["total_size"], 60);
        let map = &index["weight_map"];
        assert_eq!(map["a"], "model-00001-of-00003.safetensors");
        assert_eq!(map["b"], "model-00001-of-00003.safetensors");
        assert_eq!(map["big"], "model-00002-of-00003.safetensors");
        assert_eq!(map["c"], "model-00003-of-00003.safetensors");
        let back = read(&dir).unwrap();
        for (name, data) in &tensors {
            assert_eq!(&back[name], data, "{name}");
        }
        // A save that fits in one file replaces the shards and the index.
        write(&dir, &tensors, DEFAULT_MAX_SHARD_BYTES).unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![SINGLE.to_string()]);
        assert_eq!(read(&dir).unwrap()["big"], tensors[2].1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn an_index_that_points_wrong_is_refused() {
        let dir = std::env::temp_dir().join(format!("llama-bad-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write(
            &dir,
            &[tensor("a", vec![1.0; 4]), tensor("b", vec![2.0; 4])],
            16,
        )
        .unwrap();
        let edit = |map: Value| {
            let index = json!({ "metadata": { "total_size": 32 }, "weight_map": map });
            std::fs::write(dir.join(INDEX), index.to_string()).unwrap();
            read(&dir).unwrap_err()
        };
        let error = edit(json!({ "a": "model-00002-of-00002.safetensors" }));
        assert!(
            error.contains("says `a` is in model-00002-of-00002"),
            "{error}"
        );
        let error = edit(json!({ "a": "../elsewhere.safetensors" }));
        assert!(
            error.contains("outside the checkpoint's directory"),
            "{error}"
        );
        let error = edit(json!({ "a": "model-00009-of-00009.safetensors" }));
        assert!(error.contains("cannot read"), "{error}");
        std::fs::write(dir.join(SINGLE), b"").unwrap();
        let error = read(&dir).unwrap_err();
        assert!(error.contains("remove the one that is stale"), "{error}");
        // A shard holding a tensor its index does not list.
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        let three = [
            tensor("a", vec![1.0; 4]),
            tensor("b", vec![2.0; 4]),
            tensor("c", vec![3.0; 4]),
        ];
        write(&dir, &three, 32).unwrap();
        let error = edit(json!({
            "a": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        }));
        assert!(error.contains("holds `b`, which"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_block_reads_only_its_rows_or_columns() {
        let dir = std::env::temp_dir().join(format!("llama-blocks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let matrix = ("m".to_string(), TensorData::new(values, [3, 4]));
        write(
            &dir,
            &[matrix.clone(), tensor("v", vec![7.0; 5])],
            DEFAULT_MAX_SHARD_BYTES,
        )
        .unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        assert_eq!(checkpoint.names(), ["m", "v"]);
        assert_eq!(checkpoint.shape("m"), Some(&[3, 4][..]));
        let floats = |data: TensorData| (data.shape.to_vec(), data.to_vec::<f32>().unwrap());
        let rows = checkpoint.read_block("m", 0, 1..3).unwrap();
        assert_eq!(
            floats(rows),
            (vec![2, 4], (4..12).map(|i| i as f32).collect())
        );
        assert_eq!(checkpoint.bytes_read(), 8 * 4);
        let columns = checkpoint.read_block("m", 1, 1..3).unwrap();
        assert_eq!(
            floats(columns),
            (vec![3, 2], vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0])
        );
        assert_eq!(checkpoint.bytes_read(), 14 * 4);
        assert_eq!(checkpoint.read("m").unwrap(), matrix.1);
        let error = checkpoint.read_block("m", 1, 3..5).unwrap_err();
        assert!(
            error.contains("no elements 3..5 along dimension 1"),
            "{error}"
        );
        let error = checkpoint.read("w").unwrap_err();
        assert!(error.contains("no tensor `w`"), "{error}");
        // A file cut short, or longer than its header says, is refused when opened.
        let bytes = std::fs::read(dir.join(SINGLE)).unwrap();
        for len in [bytes.len() - 4, 6] {
            std::fs::write(dir.join(SINGLE), &bytes[..len]).unwrap();
            let error = Checkpoint::open(&dir).err().unwrap();
            assert!(error.contains(SINGLE), "{error}");
        }
        std::fs::write(dir.join(SINGLE), [&bytes[..], &[0; 4]].concat()).unwrap();
        let error = Checkpoint::open(&dir).err().unwrap();
        assert!(error.contains("is truncated or has bytes after"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn shard_names_are_recognised_exactly() {
        assert!(is_shard_name(&shard_name(3, 12)));
        assert!(!is_shard_name("model-1-of-2.safetensors"));
        assert!(!is_shard_name("model-00001-of-00002.safetensors.tmp"));
        assert!(!is_shard_name("optimizer-00001-of-00002.safetensors"));
    }
}
