//! Weights on disk: burn's own record (`model.mpk`) and Hugging Face's layout (safetensors
//! with `LlamaForCausalLM` tensor names, in one file or sharded with an index, and
//! `config.json`), so a checkpoint can go to and come from other Llama tools.
//!
//! burn stores matrices `[in, out]`; Hugging Face stores `[out, in]`: matrices are transposed
//! on the way out and back on the way in. The embedding is `[vocab, hidden]` in both.

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, Param};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde_json::Value;

use crate::config::LlamaConfig;
use crate::hf_config::{hf_config, parse_hf_config};
use crate::model::Llama;
use crate::safetensors_files;

/// File of the burn record inside a weights directory (the recorder adds `.mpk`).
pub const RECORD: &str = "model";
/// Hugging Face config inside a weights directory.
pub const CONFIG: &str = "config.json";

/// Every tensor of `model` (whole, or the part of it that it is, unsplit) under its Hugging
/// Face name, in Hugging Face's layout, as f32.
pub fn export<B: Backend>(model: &Llama<B>) -> Vec<(String, TensorData)> {
    assert!(
        model.part().tp.is_none(),
        "a tensor-parallel part holds slices; gather it with its plan before exporting"
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
            (name("mlp.gate_proj"), matrix(&layer.mlp.gate_proj)),
            (name("mlp.up_proj"), matrix(&layer.mlp.up_proj)),
            (name("mlp.down_proj"), matrix(&layer.mlp.down_proj)),
        ]);
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

/// Builds a model of shape `config` from Hugging Face tensors (f32, f16 or bf16), checking
/// every name and shape, and that no tensor is left unused.
pub fn import<B: Backend>(
    config: &LlamaConfig,
    mut tensors: HashMap<String, TensorData>,
    device: &B::Device,
) -> Result<Llama<B>, String> {
    if config.tie_word_embeddings {
        drop_tied_copy(&mut tensors)?;
    }
    let mut model = Llama::<B>::skeleton(config, device);
    let mut source = Source { tensors, device };
    let table = model.embed_tokens.as_mut().expect("a skeleton is whole");
    source.plain("model.embed_tokens.weight", table)?;
    for (i, layer) in model.layers.iter_mut().enumerate() {
        let name = |part: &str| format!("model.layers.{i}.{part}.weight");
        source.plain(&name("input_layernorm"), &mut layer.input_layernorm.weight)?;
        source.matrix(&name("self_attn.q_proj"), &mut layer.self_attn.q_proj)?;
        source.matrix(&name("self_attn.k_proj"), &mut layer.self_attn.k_proj)?;
        source.matrix(&name("self_attn.v_proj"), &mut layer.self_attn.v_proj)?;
        source.matrix(&name("self_attn.o_proj"), &mut layer.self_attn.o_proj)?;
        source.plain(
            &name("post_attention_layernorm"),
            &mut layer.post_attention_layernorm.weight,
        )?;
        source.matrix(&name("mlp.gate_proj"), &mut layer.mlp.gate_proj)?;
        source.matrix(&name("mlp.up_proj"), &mut layer.mlp.up_proj)?;
        source.matrix(&name("mlp.down_proj"), &mut layer.mlp.down_proj)?;
    }
    let norm = model.norm.as_mut().expect("a skeleton is whole");
    source.plain("model.norm.weight", &mut norm.weight)?;
    if let Some(lm_head) = &mut model.lm_head {
        source.matrix("lm_head.weight", lm_head)?;
    }
    // Rotary frequencies are computed from the config, not read: old exports carry them.
    source
        .tensors
        .retain(|name, _| !name.ends_with("rotary_emb.inv_freq"));
    if let Some(first) = source.tensors.keys().min() {
        return Err(format!(
            "the checkpoint holds {} tensor(s) this model has no place for, such as `{first}`; it is not a plain Llama of this config",
            source.tensors.len()
        ));
    }
    Ok(model)
}

/// A tied checkpoint may still hold the head: a copy of the embedding is dropped, but another
/// tensor is refused, since transformers 4 would use the embedding and 5 this head.
fn drop_tied_copy(tensors: &mut HashMap<String, TensorData>) -> Result<(), String> {
    let (Some(head), Some(embedding)) = (
        tensors.get("lm_head.weight"),
        tensors.get("model.embed_tokens.weight"),
    ) else {
        // No head to drop, or no embedding, which the import names.
        return Ok(());
    };
    // Compared as f32, so a copy stored in another precision is still a copy.
    if head.clone().convert::<f32>() != embedding.clone().convert::<f32>() {
        return Err("config.json ties the head to the embedding, but the checkpoint holds a different `lm_head.weight` (transformers 4 would use the embedding, 5 this head); set tie_word_embeddings to false to keep the head, or remove `lm_head.weight`".into());
    }
    tensors.remove("lm_head.weight");
    Ok(())
}

/// The tensors of a checkpoint, handed out by name once each.
struct Source<'a, B: Backend> {
    tensors: HashMap<String, TensorData>,
    device: &'a B::Device,
}

impl<B: Backend> Source<'_, B> {
    fn take(&mut self, name: &str, want: &[usize]) -> Result<TensorData, String> {
        let data = self
            .tensors
            .remove(name)
            .ok_or_else(|| format!("the checkpoint has no tensor `{name}`"))?;
        if data.shape.to_vec() != want {
            return Err(format!(
                "`{name}` has shape {:?}, but the config asks for {want:?}",
                data.shape
            ));
        }
        Ok(data.convert::<f32>())
    }

    /// A tensor stored in the same layout by both (norms, embedding).
    fn plain<const D: usize>(
        &mut self,
        name: &str,
        p: &mut Param<Tensor<B, D>>,
    ) -> Result<(), String> {
        let data = self.take(name, &p.dims())?;
        *p = Param::from_tensor(Tensor::from_data(data, self.device));
        Ok(())
    }

    /// A matrix, `[out, in]` in the file and `[in, out]` here.
    fn matrix(&mut self, name: &str, p: &mut Param<Tensor<B, 2>>) -> Result<(), String> {
        let [d_in, d_out] = p.dims();
        let data = self.take(name, &[d_out, d_in])?;
        *p = Param::from_tensor(Tensor::<B, 2>::from_data(data, self.device).transpose());
        Ok(())
    }
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
    let path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    parse_hf_config(&json).map_err(|e| format!("{}: {e}", dir.display()))
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
    let model = import(&config, safetensors_files::read(dir)?, device)?;
    Ok((config, model))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Int;

    #[test]
    fn export_then_import_gives_the_same_model_and_config() {
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
        let stored = safetensors_files::read_file(&dir.join(safetensors_files::SINGLE)).unwrap();
        let back = import::<Flex>(&config, stored, &device).unwrap();
        std::fs::remove_file(dir.join(format!("{RECORD}.mpk"))).unwrap();
        let (_, loaded) = load::<Flex>(&dir, &device).unwrap();
        let tokens = Tensor::<Flex, 2, Int>::from_ints([[3, 1, 4, 1, 5]], &device);
        let logits = |m: &Llama<Flex>| m.forward(tokens.clone()).unwrap().into_data();
        assert_eq!(logits(&model), logits(&back));
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
        // tensor with no place.
        let embedding = stored["model.embed_tokens.weight"].clone();
        let with = |name: &str, data: TensorData| {
            let mut tensors = stored.clone();
            tensors.insert(name.into(), data);
            import::<Flex>(&tied_config, tensors, &device)
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
        let q = &export(&model)[1];
        assert_eq!(q.0, "model.layers.0.input_layernorm.weight");
        assert_eq!(export(&model)[2].1.shape.to_vec(), vec![128, 128]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
