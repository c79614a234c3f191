//! Weights on disk: burn's own record (`model.mpk`) and Hugging Face's layout (safetensors
//! with `LlamaForCausalLM` tensor names, in one file or sharded with an index, and
//! `config.json`), so a checkpoint can go to and come from other Llama tools.
//!
//! burn stores matrices `[in, out]`; Hugging Face stores `[out, in]`: matrices are transposed
//! on the way out and back on the way in. The embedding is `[vocab, hidden]` in both.

use std::collections::BTreeSet;
use std::path::Path;

use burn::module::{Module, Param};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde_json::Value;

use crate::config::LlamaConfig;
use crate::hf_config::{hf_config, parse_hf_config};
use crate::model::Llama;
use crate::parallel_plan::parameters;
use crate::safetensors_files::{self, Checkpoint};
use crate::weights::{Block, Loaded, ParamSource, Weights, stack};

/// File of the burn record inside a weights directory (the recorder adds `.mpk`).
pub const RECORD: &str = "model";
/// Hugging Face config inside a weights directory.
pub const CONFIG: &str = "config.json";

/// Every tensor of `model` (whole, or the part of it that it is, unsplit) under its Hugging
/// Face name, in Hugging Face's layout, as f32.
pub fn export<B: Backend>(model: &Llama<B>) -> Vec<(String, TensorData)> {
    let split_experts = (model.part().experts.as_ref()).is_some_and(|e| e.ep.size() > 1);
    assert!(
        model.part().tp.is_none() && !split_experts,
        "a tensor- or expert-parallel part holds slices; gather it with its plan before exporting"
    );
    let matrix = |p: &Param<Tensor<B, 2>>| p.val().transpose().into_data().convert::<f32>();
    let vector = |p: &Param<Tensor<B, 1>>| p.val().into_data().convert::<f32>();
    let mut out = Vec::new();
    if let Some(table) = &model.embed_tokens {
        out.push((
            "model.embed_tokens.weight".to_string(),
            table.val().into_data().convert::<f32>(),
        ));
    }
    let first = model.part().layers.start;
    for (i, layer) in (first..).zip(&model.layers) {
        let name = |part: &str| format!("model.layers.{i}.{part}.weight");
        out.extend([
            (
                name("input_layernorm"),
                vector(&layer.input_layernorm.weight),
            ),
            (name("self_attn.q_proj"), matrix(&layer.self_attn.q_proj)),
            (name("self_attn.k_proj"), matrix(&layer.self_attn.k_proj)),
            (name("self_attn.v_proj"), matrix(&layer.self_attn.v_proj)),
            (name("self_attn.o_proj"), matrix(&layer.self_attn.o_proj)),
            (
                name("post_attention_layernorm"),
                vector(&layer.post_attention_layernorm.weight),
            ),
        ]);
        if let Some(mlp) = &layer.mlp {
            out.extend([
                (name("mlp.gate_proj"), matrix(&mlp.gate_proj)),
                (name("mlp.up_proj"), matrix(&mlp.up_proj)),
                (name("mlp.down_proj"), matrix(&mlp.down_proj)),
            ]);
        }
        if let Some(moe) = &layer.moe {
            let path = |part: &str| format!("layers.{i}.moe.{part}");
            out.push((self::name(&path("router")), matrix(&moe.router)));
            for (which, experts) in [("gate", &moe.gate), ("up", &moe.up), ("down", &moe.down)] {
                // Each expert's matrix, transposed as the others are.
                let stacked = experts.val().swap_dims(1, 2);
                for j in 0..stacked.dims()[0] {
                    let [_, rows, columns] = stacked.dims();
                    let one = stacked.clone().narrow(0, j, 1).reshape([rows, columns]);
                    out.push((
                        expert_name(&path(which), j),
                        one.into_data().convert::<f32>(),
                    ));
                }
            }
        }
    }
    if let Some(norm) = &model.norm {
        out.push(("model.norm.weight".into(), vector(&norm.weight)));
    }
    // A tied head has no tensor of its own, as transformers saves it.
    if let Some(lm_head) = &model.lm_head {
        out.push(("lm_head.weight".into(), matrix(lm_head)));
    }
    out
}

/// The Hugging Face name of the parameter at `path` in the whole model (burn's visitors'
/// path, such as `layers.5.mlp.up_proj`); `Llama::init` draws each matrix by this name. A
/// mixture of experts is named as Mixtral's: its router (`layers.5.moe.router`) is
/// `block_sparse_moe.gate`; its stacked experts are one tensor per expert ([`expert_name`]).
pub fn name(path: &str) -> String {
    if let Some(block) = path.strip_suffix(".moe.router") {
        return format!("model.{block}.block_sparse_moe.gate.weight");
    }
    match path {
        "lm_head" => "lm_head.weight".into(),
        path if path.ends_with(".weight") => format!("model.{path}"),
        path => format!("model.{path}.weight"),
    }
}

/// Mixtral's names of the experts' matrices stacked at `path` (`layers.5.moe.gate`, `up`,
/// `down`): `w1`, `w3` and `w2` of each expert.
const EXPERT_MATRICES: [(&str, &str); 3] = [("gate", "w1"), ("up", "w3"), ("down", "w2")];

/// Whether the parameter at `path` holds a block's experts stacked, one matrix per expert.
pub fn is_experts(path: &str) -> bool {
    EXPERT_MATRICES.iter().any(|(which, _)| {
        path.strip_suffix(which)
            .is_some_and(|p| p.ends_with(".moe."))
    })
}

/// The Hugging Face name of expert `expert`'s matrix in the stacked experts at `path` (see
/// [`is_experts`]).
pub fn expert_name(path: &str, expert: usize) -> String {
    let (block, which) = path
        .rsplit_once(".moe.")
        .expect("a stacked experts' path names its block's moe");
    let (_, w) = EXPERT_MATRICES
        .iter()
        .find(|(name, _)| *name == which)
        .expect("gate, up or down");
    format!("model.{block}.block_sparse_moe.experts.{expert}.{w}.weight")
}

/// Whether Hugging Face stores the parameter at `path`, of `rank` dimensions, transposed:
/// every matrix but the embedding (each expert's matrix of stacked experts too).
fn transposed(path: &str, rank: usize) -> bool {
    (rank == 2 && path != "embed_tokens") || (rank == 3 && is_experts(path))
}

/// A Hugging Face checkpoint of a model shaped as a config, read a block at a time.
pub struct HfCheckpoint {
    checkpoint: Checkpoint,
}

impl HfCheckpoint {
    /// The safetensors checkpoint in `dir` (f32, f16 or bf16, one file or sharded), checked
    /// against `config` from its headers: every tensor the model needs is there in its shape,
    /// and none is left over.
    pub fn open(dir: &Path, config: &LlamaConfig) -> Result<Self, String> {
        let checkpoint = Checkpoint::open(dir)?;
        let mut unused: BTreeSet<&str> = checkpoint.names().into_iter().collect();
        for (path, shape) in parameters(config) {
            for (name, want) in stored(&path, &shape) {
                let have = checkpoint
                    .shape(&name)
                    .ok_or_else(|| format!("the checkpoint has no tensor `{name}`"))?;
                if have != want.as_slice() {
                    return Err(format!(
                        "`{name}` has shape {have:?}, but the config asks for {want:?}"
                    ));
                }
                unused.remove(name.as_str());
            }
        }
        if config.tie_word_embeddings && unused.remove("lm_head.weight") {
            check_tied_copy(&checkpoint)?;
        }
        // Rotary frequencies are computed from the config, not read: old exports carry them.
        unused.retain(|name| !name.ends_with("rotary_emb.inv_freq"));
        if let Some(first) = unused.first() {
            return Err(format!(
                "the checkpoint holds {} tensor(s) this model has no place for, such as `{first}`; it is not a plain Llama of this config",
                unused.len()
            ));
        }
        Ok(Self { checkpoint })
    }

    /// Bytes of tensor data read so far.
    pub fn bytes_read(&self) -> u64 {
        self.checkpoint.bytes_read()
    }
}

/// The tensors Hugging Face keeps the parameter at `path`, shaped `shape` in burn's layout, as:
/// its name and stored shape, or, for stacked experts, each expert's.
fn stored(path: &str, shape: &[usize]) -> Vec<(String, Vec<usize>)> {
    let reversed = |shape: &[usize]| {
        let mut shape = shape.to_vec();
        if transposed(path, shape.len()) {
            shape.reverse();
        }
        shape
    };
    match shape {
        [experts, matrix @ ..] if is_experts(path) => (0..*experts)
            .map(|j| (expert_name(path, j), reversed(matrix)))
            .collect(),
        _ => vec![(name(path), reversed(shape))],
    }
}

impl HfCheckpoint {
    /// The rows and columns `block` holds of the matrix `name`, whose last two dimensions are
    /// the block's `matrix` and `matrix + 1` (stored transposed when `transposed`).
    fn read_matrix(
        &self,
        name: &str,
        block: &Block<'_>,
        matrix: usize,
        transposed: bool,
    ) -> Result<TensorData, String> {
        let split: Vec<(usize, std::ops::Range<usize>)> = block
            .split
            .iter()
            .filter(|(dim, _)| *dim >= matrix)
            .map(|(dim, range)| (dim - matrix, range.clone()))
            .collect();
        match split.as_slice() {
            [] => self.checkpoint.read(name),
            [(dim, range)] => {
                let stored_dim = if transposed { 1 - dim } else { *dim };
                self.checkpoint.read_block(name, stored_dim, range.clone())
            }
            _ => Err(format!(
                "`{name}` would be read split along two dimensions; the plan splits a matrix along one"
            )),
        }
    }
}

impl ParamSource for HfCheckpoint {
    fn block(&self, block: &Block<'_>) -> Result<Option<Loaded>, String> {
        let transposed = transposed(block.path, block.whole.len());
        let data = if is_experts(block.path) {
            let experts = block
                .range(0)
                .map(|j| {
                    let matrix =
                        self.read_matrix(&expert_name(block.path, j), block, 1, transposed);
                    matrix.map(|m| m.convert::<f32>())
                })
                .collect::<Result<Vec<_>, _>>()?;
            stack(experts)
        } else {
            self.read_matrix(&name(block.path), block, 0, transposed)?
                .convert::<f32>()
        };
        Ok(Some(Loaded { data, transposed }))
    }
}

/// A tied checkpoint may still hold the head: a copy of the embedding is let be, another
/// tensor is refused, since transformers 4 would use the embedding and 5 this head.
fn check_tied_copy(checkpoint: &Checkpoint) -> Result<(), String> {
    let head = checkpoint.read("lm_head.weight")?;
    let embedding = checkpoint.read("model.embed_tokens.weight")?;
    // Compared as f32, so a copy stored in another precision is still a copy.
    if head.convert::<f32>() != embedding.convert::<f32>() {
        return Err("config.json ties the head to the embedding, but the checkpoint holds a different `lm_head.weight` (transformers 4 would use the embedding, 5 this head); set tie_word_embeddings to false to keep the head, or remove `lm_head.weight`".into());
    }
    Ok(())
}

/// Writes `model` into `dir`: burn's record, the safetensors export (sharded above
/// `max_shard_bytes`, as transformers' `max_shard_size`) and `config.json`.
pub fn save<B: Backend>(
    model: &Llama<B>,
    config: &LlamaConfig,
    dir: &Path,
    max_shard_bytes: u64,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    model
        .clone()
        .save_file(
            dir.join(RECORD),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
        )
        .map_err(|e| format!("cannot write the burn record in {}: {e}", dir.display()))?;
    safetensors_files::write(dir, &export(model), max_shard_bytes)?;
    let json = serde_json::to_string_pretty(&hf_config(config)).expect("a JSON value prints");
    std::fs::write(dir.join(CONFIG), json)
        .map_err(|e| format!("cannot write {}: {e}", dir.join(CONFIG).display()))
}

/// The shape `dir`'s `config.json` gives, without reading any weights.
pub fn load_config(dir: &Path) -> Result<LlamaConfig, String> {
    read_config(&dir.join(CONFIG))
}

/// The model shape of a `config.json` file.
pub fn read_config(path: &Path) -> Result<LlamaConfig, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    parse_hf_config(&json).map_err(|e| format!("{}: {e}", path.display()))
}

/// Loads `dir`: its `config.json`, then burn's record if there is one, else the safetensors
/// (f32, f16 or bf16, one file or sharded), converted to f32.
pub fn load<B: Backend>(dir: &Path, device: &B::Device) -> Result<(LlamaConfig, Llama<B>), String> {
    let config = load_config(dir)?;
    let record = dir.join(format!("{RECORD}.mpk"));
    if record.exists() {
        let model = Llama::<B>::skeleton(&config, device)
            .load_file(
                dir.join(RECORD),
                &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
                device,
            )
            .map_err(|e| format!("cannot load {}: {e}", record.display()))?;
        return Ok((config, model));
    }
    let checkpoint = HfCheckpoint::open(dir, &config)?;
    let model = Weights::Checkpoint(checkpoint)
        .whole(&config, device)
        .map_err(|e| e.to_string())?;
    Ok((config, model))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Int;

    /// Loads `tensors` written as safetensors beside `dir`'s config.json, in `dir`/`case`.
    fn load_tensors(
        dir: &Path,
        case: &str,
        tensors: &HashMap<String, TensorData>,
    ) -> Result<Llama<Flex>, String> {
        let case = dir.join(case);
        std::fs::create_dir_all(&case).unwrap();
        std::fs::copy(dir.join(CONFIG), case.join(CONFIG)).unwrap();
        let tensors: Vec<_> = tensors
            .iter()
            .map(|(name, data)| (name.clone(), data.clone()))
            .collect();
        safetensors_files::write(&case, &tensors, safetensors_files::DEFAULT_MAX_SHARD_BYTES)
            .unwrap();
        load::<Flex>(&case, &Default::default()).map(|(_, model)| model)
    }

    #[test]
    fn export_then_load_gives_the_same_model_and_config() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let device = Default::default();
        let model = Llama::<Flex>::init(&config, 3, &device);
        let dir = std::env::temp_dir().join(format!("llama-hf-{}", std::process::id()));
        save(
            &model,
            &config,
            &dir,
            safetensors_files::DEFAULT_MAX_SHARD_BYTES,
        )
        .unwrap();
        assert_eq!(parse_hf_config(&hf_config(&config)).unwrap(), config);
        let tokens = Tensor::<Flex, 2, Int>::from_ints([[3, 1, 4, 1, 5]], &device);
        let logits = |m: &Llama<Flex>| m.forward(tokens.clone()).unwrap().into_data();
        let (_, from_record) = load::<Flex>(&dir, &device).unwrap();
        assert_eq!(logits(&model), logits(&from_record));
        std::fs::remove_file(dir.join(format!("{RECORD}.mpk"))).unwrap();
        let (_, loaded) = load::<Flex>(&dir, &device).unwrap();
        assert_eq!(logits(&model), logits(&loaded));
        // Tied: no head of its own in the file, and the embedding serves as the head again.
        let tied_config = config.clone().with_tie_word_embeddings(true);
        let tied = Llama::<Flex>::init(&tied_config, 3, &device);
        let tied_dir = dir.join("tied");
        save(
            &tied,
            &tied_config,
            &tied_dir,
            safetensors_files::DEFAULT_MAX_SHARD_BYTES,
        )
        .unwrap();
        std::fs::remove_file(tied_dir.join(format!("{RECORD}.mpk"))).unwrap();
        let stored = safetensors_files::read(&tied_dir).unwrap();
        assert!(!stored.contains_key("lm_head.weight"));
        let (shape, loaded) = load::<Flex>(&tied_dir, &device).unwrap();
        assert_eq!(shape, tied_config);
        assert!(loaded.lm_head.is_none());
        assert_eq!(logits(&tied), logits(&loaded));
        // A head that is a copy of the embedding loads; another head is refused, as is a
        // tensor with no place, a missing one and one of another shape.
        let embedding = stored["model.embed_tokens.weight"].clone();
        let with = |name: &str, data: TensorData| {
            let mut tensors = stored.clone();
            tensors.insert(name.into(), data);
            load_tensors(&tied_dir, "case", &tensors)
        };
        assert!(with("lm_head.weight", embedding.clone()).is_ok());
        let other = TensorData::new(vec![0.5f32; 256 * 128], [256, 128]);
        let error = with("lm_head.weight", other).unwrap_err();
        assert!(error.contains("different `lm_head.weight`"), "{error}");
        let error = with("model.layers.0.self_attn.q_proj.bias", embedding).unwrap_err();
        assert!(
            error.contains("`model.layers.0.self_attn.q_proj.bias`"),
            "{error}"
        );
        let error = with("model.norm.weight", TensorData::new(vec![1.0f32; 64], [64])).unwrap_err();
        assert!(
            error.contains("`model.norm.weight` has shape [64], but the config asks for [128]"),
            "{error}"
        );
        let mut missing = stored.clone();
        missing.remove("model.layers.1.mlp.up_proj.weight");
        let error = load_tensors(&tied_dir, "case", &missing).unwrap_err();
        assert!(
            error.contains("no tensor `model.layers.1.mlp.up_proj.weight`"),
            "{error}"
        );
        let q = &export(&model)[1];
        assert_eq!(q.0, "model.layers.0.input_layernorm.weight");
        assert_eq!(export(&model)[2].1.shape.to_vec(), vec![128, 128]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn names_are_hugging_faces() {
        assert_eq!(name("embed_tokens"), "model.embed_tokens.weight");
        assert_eq!(
            name("layers.3.mlp.up_proj"),
            "model.layers.3.mlp.up_proj.weight"
        );
        assert_eq!(
            name("layers.3.input_layernorm.weight"),
            "model.layers.3.input_layernorm.weight"
        );
        assert_eq!(name("norm.weight"), "model.norm.weight");
        assert_eq!(name("lm_head"), "lm_head.weight");
    }
}
