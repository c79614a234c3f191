//! A checkpoint's tensors in safetensors files as transformers lays them out: one
//! `model.safetensors`, or, above a size limit, shards `model-0000N-of-0000M.safetensors` and
//! `model.safetensors.index.json` mapping each tensor to its shard.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{Value, json};

/// The single file of an unsharded checkpoint.
pub const SINGLE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX: &str = "model.safetensors.index.json";
/// transformers 4's default shard limit (`max_shard_size="5GB"`, decimal gigabytes; 5 writes
/// 50GB shards), which both read.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Writes `tensors` (f32) into `dir`: one file if they fit in `max_shard_bytes`, else shards
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

/// Every tensor of the checkpoint in `dir`, in its stored dtype: from the index and its
/// shards when there is an index, else from the single file. Both at once are refused, since
/// transformers would read the single file and might not read the same weights.
pub fn read(dir: &Path) -> Result<HashMap<String, TensorData>, String> {
    let index = dir.join(INDEX);
    if !index.exists() {
        return read_file(&dir.join(SINGLE));
    }
    if dir.join(SINGLE).exists() {
        return Err(format!(
            "{} holds both {SINGLE} and {INDEX}, which transformers would not read alike; remove the one that is stale",
            dir.display()
        ));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|e| format!("cannot read {}: {e}", index.display()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", index.display()))?;
    let weight_map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| format!("{} has no weight_map", index.display()))?;
    let mut by_shard: HashMap<&str, Vec<&str>> = HashMap::new();
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
    let mut tensors = HashMap::new();
    for (shard, names) in by_shard {
        let path = dir.join(shard);
        let mut stored = read_file(&path)?;
        for name in names {
            let data = stored.remove(name).ok_or_else(|| {
                format!(
                    "{} says `{name}` is in {shard}, but it is not",
                    index.display()
                )
            })?;
            tensors.insert(name.to_string(), data);
        }
        if let Some(name) = stored.keys().min() {
            return Err(format!(
                "{shard} holds `{name}`, which {} does not list; a reader that loads whole shards would see it, so remove it or list it",
                index.display()
            ));
        }
    }
    Ok(tensors)
}

/// Every tensor of one safetensors file, in its stored dtype (f32, f16 or bf16).
pub fn read_file(path: &Path) -> Result<HashMap<String, TensorData>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Every tensor of a safetensors file's bytes, in its stored dtype.
pub fn parse(bytes: &[u8]) -> Result<HashMap<String, TensorData>, String> {
    let file =
        SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = match view.dtype() {
                Dtype::F32 => DType::F32,
                Dtype::F16 => DType::F16,
                Dtype::BF16 => DType::BF16,
                other => {
                    return Err(format!(
                        "`{name}` is {other:?}; only f32, f16 and bf16 load"
                    ));
                }
            };
            let data =
                TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype);
            Ok((name, data))
        })
        .collect()
}

/// `model-0000i-of-0000n.safetensors`, transformers' shard name.
fn shard_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}

/// One safetensors file of f32 tensors.
fn write_file(path: &Path, tensors: &[&(String, TensorData)]) -> Result<(), String> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            let view = TensorView::new(Dtype::F32, data.shape.to_vec(), data.as_bytes())
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
    fn shard_names_are_recognised_exactly() {
        assert!(is_shard_name(&shard_name(3, 12)));
        assert!(!is_shard_name("model-1-of-2.safetensors"));
        assert!(!is_shard_name("model-00001-of-00002.safetensors.tmp"));
        assert!(!is_shard_name("optimizer-00001-of-00002.safetensors"));
    }
}
