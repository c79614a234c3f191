//! Hugging Face's `config.json`: read in the layouts of transformers 4 and 5 alike, and written
//! so that both read it back the same.
//!
//! transformers 4 keeps the rotary base at the top (`rope_theta`) and its scaling in
//! `rope_scaling`; transformers 5 keeps both in `rope_parameters` (and still reads
//! `rope_scaling`, which wins over `rope_parameters`). transformers 4 ignores
//! `rope_parameters`, so a file with only that loads there with base 10000 and no scaling: we
//! write both layouts. Every field that changes what the model computes is either read or
//! refused with a sentence naming it; fields that only describe the file (`dtype`,
//! `architectures`, token ids, `use_cache`) or how transformers computes the same products
//! (`pretraining_tp`) are left alone.

use serde_json::{Map, Value, json};

use crate::config::LlamaConfig;
use crate::rope::RopeScaling;

/// transformers' rotary base when a config names none.
const DEFAULT_THETA: f64 = 10_000.0;

/// Hugging Face's `config.json` for `config`.
pub fn hf_config(config: &LlamaConfig) -> Value {
    let scaling = match config.rope_scaling {
        RopeScaling::Default => Value::Null,
        scaling => json!(scaling),
    };
    let mut rope_parameters = match &scaling {
        Value::Object(fields) => fields.clone(),
        _ => Map::from_iter([("rope_type".to_string(), json!("default"))]),
    };
    rope_parameters.insert("rope_theta".into(), json!(config.rope_theta));
    let (architecture, model_type) = match config.is_moe() {
        false => ("LlamaForCausalLM", "llama"),
        true => ("MixtralForCausalLM", "mixtral"),
    };
    let mut json = json!({
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": false,
        "mlp_bias": false,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim(),
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
    });
    if config.is_moe() {
        let fields = json.as_object_mut().expect("an object");
        for (key, value) in [
            ("num_local_experts", json!(config.num_local_experts)),
            ("num_experts_per_tok", json!(config.num_experts_per_tok)),
            ("router_aux_loss_coef", json!(config.router_aux_loss_coef)),
            ("router_jitter_noise", json!(0.0)),
            ("output_router_logits", json!(false)),
            ("sliding_window", Value::Null),
            // Training settings transformers does not read, kept for this trainer.
            ("router_z_loss_coef", json!(config.router_z_loss_coef)),
            (
                "expert_capacity_factor",
                json!(config.expert_capacity_factor),
            ),
        ] {
            fields.insert(key.into(), value);
        }
    }
    json
}

/// Reads the shape from a Hugging Face `config.json`, refusing what this model cannot express.
pub fn parse_hf_config(json: &Value) -> Result<LlamaConfig, String> {
    let fields = json.as_object().ok_or("config.json is not a JSON object")?;
    let config = Fields(fields);
    let moe = match config.string("model_type")? {
        None | Some("llama") => false,
        Some("mixtral") => true,
        Some(kind) => {
            return Err(format!(
                "config.json is for model_type `{kind}`; `llama` and `mixtral` load"
            ));
        }
    };
    if moe {
        config.refuse_unless(
            "router_jitter_noise",
            &json!(0.0),
            "this trainer's router adds no noise",
        )?;
        if config.optional_size("num_experts_per_tok")? == Some(1) {
            return Err("config.json routes each token to one expert (num_experts_per_tok 1): Mixtral then weighs it by 1, where this model keeps its router probability (as Switch does); route to 2 or more".into());
        }
        if let Some(window) = config.optional_size("sliding_window")? {
            return Err(format!(
                "config.json sets sliding_window {window}; this model's attention sees every earlier token (set it to null)"
            ));
        }
    }
    for (key, want, why) in [
        (
            "attention_bias",
            json!(false),
            "the checkpoint's attention projections have biases; this model's have none",
        ),
        (
            "mlp_bias",
            json!(false),
            "the checkpoint's MLP has biases; this model's has none",
        ),
        (
            "hidden_act",
            json!("silu"),
            "this model's MLP is SwiGLU, with silu (or swish, its other name)",
        ),
        (
            "attention_dropout",
            json!(0.0),
            "this trainer has no dropout",
        ),
    ] {
        config.refuse_unless(key, &want, why)?;
    }
    if config.get("quantization_config").is_some() {
        return Err(
            "config.json has a quantization_config; only f32, f16 and bf16 weights load".into(),
        );
    }
    let heads = config.size("num_attention_heads")?;
    let (rope_theta, rope_scaling) = parse_rope(&config)?;
    let max_positions = config
        .optional_size("max_position_embeddings")?
        .unwrap_or(2048);
    let top_context = config.optional_size("original_max_position_embeddings")?;
    let rope_scaling = rope_scaling.resolve(max_positions, top_context)?;
    let model = LlamaConfig::new(
        config.size("vocab_size")?,
        config.size("hidden_size")?,
        config.size("intermediate_size")?,
        config.size("num_hidden_layers")?,
        heads,
        config
            .optional_size("num_key_value_heads")?
            .unwrap_or(heads),
    )
    .with_max_position_embeddings(max_positions)
    .with_rope_theta(rope_theta)
    .with_rope_scaling(rope_scaling)
    .with_tie_word_embeddings(config.boolean("tie_word_embeddings")?.unwrap_or(false))
    .with_rms_norm_eps(config.float("rms_norm_eps")?.unwrap_or(1e-6))
    .with_initializer_range(config.float("initializer_range")?.unwrap_or(0.02));
    let model = match moe {
        false => model,
        // transformers' Mixtral defaults where the file says nothing.
        true => model
            .with_num_local_experts(config.optional_size("num_local_experts")?.unwrap_or(8))
            .with_num_experts_per_tok(config.optional_size("num_experts_per_tok")?.unwrap_or(2))
            .with_router_aux_loss_coef(config.float("router_aux_loss_coef")?.unwrap_or(0.001))
            .with_router_z_loss_coef(config.float("router_z_loss_coef")?.unwrap_or(0.0))
            .with_expert_capacity_factor(config.float("expert_capacity_factor")?),
    };
    // Before head_dim, which divides by the heads.
    model.validate().map_err(|e| format!("config.json: {e}"))?;
    if let Some(head_dim) = config
        .optional_size("head_dim")?
        .filter(|&d| d != model.head_dim())
    {
        return Err(format!(
            "config.json sets head_dim {head_dim}, but this model uses hidden_size / num_attention_heads = {}",
            model.head_dim()
        ));
    }
    Ok(model)
}

/// The rotary base and scaling, from either layout; where both layouts say something they
/// must agree, since transformers 4 and 5 would each read another one.
fn parse_rope(config: &Fields) -> Result<(f64, RopeSpec), String> {
    let legacy = config.object("rope_scaling")?;
    let current = config.object("rope_parameters")?;
    let top_theta = config.float("rope_theta")?;
    let specs = [("rope_scaling", legacy), ("rope_parameters", current)]
        .into_iter()
        .filter_map(|(key, fields)| fields.map(|f| RopeSpec::parse(key, f, top_theta)))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(factor) = config.float("partial_rotary_factor")?.filter(|&f| f != 1.0) {
        return Err(partial_rotary(factor));
    }
    match specs.as_slice() {
        [] => Ok((top_theta.unwrap_or(DEFAULT_THETA), RopeSpec::default())),
        [one] => Ok((one.theta, one.clone())),
        [legacy, current] if legacy == current => Ok((current.theta, current.clone())),
        [legacy, current] => Err(format!(
            "config.json's rope_scaling ({legacy}) and rope_parameters ({current}) disagree; transformers 4 and 5 both read rope_scaling, so make rope_parameters match it or remove it"
        )),
        _ => unreachable!("two layouts at most"),
    }
}

fn partial_rotary(factor: f64) -> String {
    format!("config.json sets partial_rotary_factor {factor}; this model rotates whole heads (1.0)")
}

/// One layout's rotary settings, before a missing `original_max_position_embeddings` is
/// filled in from the model's.
#[derive(Debug, Clone, PartialEq)]
struct RopeSpec {
    theta: f64,
    kind: String,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

impl Default for RopeSpec {
    fn default() -> Self {
        Self {
            theta: DEFAULT_THETA,
            kind: "default".into(),
            factor: None,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
        }
    }
}

impl std::fmt::Display for RopeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} with theta {}", self.kind, self.theta)?;
        for (name, value) in [
            ("factor", self.factor),
            ("low_freq_factor", self.low_freq_factor),
            ("high_freq_factor", self.high_freq_factor),
        ] {
            if let Some(value) = value {
                write!(f, ", {name} {value}")?;
            }
        }
        if let Some(context) = self.original_max_position_embeddings {
            write!(f, ", original_max_position_embeddings {context}")?;
        }
        Ok(())
    }
}

impl RopeSpec {
    /// The settings under `key`: `rope_type` (or transformers 4's `type`) and the parameters
    /// that type takes, each checked; the base from the object, else `top_theta`.
    fn parse(
        key: &str,
        fields: &Map<String, Value>,
        top_theta: Option<f64>,
    ) -> Result<Self, String> {
        let object = Fields(fields);
        let kind = match (object.string("rope_type")?, object.string("type")?) {
            (Some(a), Some(b)) if a != b => {
                return Err(format!(
                    "config.json's {key} names two rotary types, rope_type `{a}` and type `{b}`"
                ));
            }
            (Some(kind), _) | (None, Some(kind)) => kind.to_string(),
            (None, None) => "default".into(),
        };
        let theta = match (object.float("rope_theta")?, top_theta) {
            (Some(inner), Some(top)) if inner != top => {
                return Err(format!(
                    "config.json sets rope_theta {top}, but its {key} sets rope_theta {inner}; transformers 4 and 5 would each read another, so make them agree"
                ));
            }
            (Some(theta), _) | (None, Some(theta)) => theta,
            (None, None) => DEFAULT_THETA,
        };
        if let Some(factor) = object.float("partial_rotary_factor")?.filter(|&f| f != 1.0) {
            return Err(partial_rotary(factor));
        }
        let takes: &[&str] = match kind.as_str() {
            "default" => &[],
            "linear" => &["factor"],
            "llama3" => &[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ],
            other => {
                return Err(format!(
                    "config.json's {key} asks for the `{other}` rotary scaling; this model implements default, linear and llama3"
                ));
            }
        };
        let known = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
        if let Some(extra) = fields
            .keys()
            .find(|k| !known.contains(&k.as_str()) && !takes.contains(&k.as_str()))
        {
            return Err(format!(
                "config.json's {key} sets `{extra}`, which the {kind} rotary scaling does not take; this model would ignore it, so remove it"
            ));
        }
        let required = |name: &str| -> Result<f64, String> {
            object.float(name)?.ok_or_else(|| {
                format!(
                    "config.json's {key} asks for the {kind} rotary scaling but sets no `{name}`"
                )
            })
        };
        let needs = |name| takes.contains(&name);
        Ok(Self {
            theta,
            factor: needs("factor").then(|| required("factor")).transpose()?,
            low_freq_factor: needs("low_freq_factor")
                .then(|| required("low_freq_factor"))
                .transpose()?,
            high_freq_factor: needs("high_freq_factor")
                .then(|| required("high_freq_factor"))
                .transpose()?,
            original_max_position_embeddings: object
                .optional_size("original_max_position_embeddings")?,
            kind,
        })
    }

    /// The scaling. llama3's `original_max_position_embeddings` comes from the rotary
    /// settings, else from the top level (`top_context`, which transformers 5 prefers and 4
    /// ignores: where both are given they must agree), else from `max_position_embeddings`.
    fn resolve(
        &self,
        max_positions: usize,
        top_context: Option<usize>,
    ) -> Result<RopeScaling, String> {
        let value = |v: Option<f64>| v.expect("parse checked it");
        let context = match (self.original_max_position_embeddings, top_context) {
            (Some(inner), Some(top)) if inner != top && self.kind == "llama3" => {
                return Err(format!(
                    "config.json sets original_max_position_embeddings {top}, but its rotary settings say {inner}; transformers 5 would use the first, 4 the second, so make them agree"
                ));
            }
            (Some(context), _) | (None, Some(context)) => context,
            (None, None) => max_positions,
        };
        Ok(match self.kind.as_str() {
            "linear" => RopeScaling::Linear {
                factor: value(self.factor),
            },
            "llama3" => RopeScaling::Llama3 {
                factor: value(self.factor),
                low_freq_factor: value(self.low_freq_factor),
                high_freq_factor: value(self.high_freq_factor),
                original_max_position_embeddings: context,
            },
            _ => RopeScaling::Default,
        })
    }
}

/// A JSON object read with sentences for every wrong type.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    /// A present, non-null value.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn size(&self, key: &str) -> Result<usize, String> {
        self.optional_size(key)?
            .ok_or_else(|| format!("config.json has no integer `{key}`"))
    }

    fn optional_size(&self, key: &str) -> Result<Option<usize>, String> {
        self.typed(key, "a whole number", |v| v.as_u64().map(|n| n as usize))
    }

    fn float(&self, key: &str) -> Result<Option<f64>, String> {
        self.typed(key, "a number", Value::as_f64)
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, String> {
        self.typed(key, "true or false", Value::as_bool)
    }

    fn string(&self, key: &str) -> Result<Option<&str>, String> {
        self.typed(key, "a string", Value::as_str)
    }

    fn object(&self, key: &str) -> Result<Option<&Map<String, Value>>, String> {
        self.typed(key, "an object", Value::as_object)
    }

    /// `key`'s value read by `read`, if present; a sentence naming `what` it should be when
    /// `read` cannot.
    fn typed<'v, T>(
        &'v self,
        key: &str,
        what: &str,
        read: impl Fn(&'v Value) -> Option<T>,
    ) -> Result<Option<T>, String> {
        self.get(key)
            .map(|v| read(v).ok_or_else(|| format!("config.json's `{key}` is {v}, not {what}")))
            .transpose()
    }

    /// Refuses `key` when it is present with another value than `want`, which is all this
    /// model computes; `why` says what the model does instead.
    fn refuse_unless(&self, key: &str, want: &Value, why: &str) -> Result<(), String> {
        match self.get(key) {
            // transformers' other name for silu.
            Some(value) if key == "hidden_act" && value == "swish" => Ok(()),
            Some(value) if !same_value(value, want) => {
                Err(format!("config.json sets {key} to {value}: {why}"))
            }
            _ => Ok(()),
        }
    }
}

/// JSON equality that takes `0` and `0.0` as the same number.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixture written by transformers itself (`scripts/make_hf_config_fixtures.py`).
    fn fixture(name: &str) -> Result<LlamaConfig, String> {
        let path = format!(
            "{}/tests/fixtures/hf_config/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        parse_hf_config(&serde_json::from_str(&text).unwrap())
    }

    fn tiny(theta: f64, scaling: RopeScaling) -> LlamaConfig {
        LlamaConfig::new(256, 128, 512, 4, 4, 2)
            .with_max_position_embeddings(256)
            .with_rms_norm_eps(1e-6)
            .with_rope_theta(theta)
            .with_rope_scaling(scaling)
    }

    const LLAMA3: RopeScaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };

    #[test]
    fn both_transformers_layouts_are_read() {
        let linear = |factor| RopeScaling::Linear { factor };
        for (name, want) in [
            ("v5_default_theta", tiny(500_000.0, RopeScaling::Default)),
            ("v5_llama3", tiny(500_000.0, LLAMA3)),
            ("v5_linear", tiny(10_000.0, linear(2.0))),
            ("v5_from_legacy_keys", tiny(250_000.0, linear(4.0))),
            ("v4_default", tiny(10_000.0, RopeScaling::Default)),
            ("v4_llama3", tiny(500_000.0, LLAMA3)),
            ("v4_linear_type", tiny(10_000.0, linear(2.0))),
        ] {
            assert_eq!(fixture(name), Ok(want), "{name}");
        }
        assert_eq!(
            fixture("v5_tied"),
            Ok(tiny(10_000.0, RopeScaling::Default).with_tie_word_embeddings(true))
        );
        assert_eq!(
            fixture("v5_llama_1b_untied"),
            Ok(LlamaConfig::preset("llama-1b").unwrap())
        );
    }

    #[test]
    fn what_the_model_cannot_compute_is_refused_by_name() {
        for (name, words) in [
            ("v5_dynamic", "`dynamic` rotary scaling"),
            ("v4_dynamic", "`dynamic` rotary scaling"),
            ("v5_yarn", "`yarn` rotary scaling"),
            ("v5_partial_rotary", "partial_rotary_factor 0.5"),
            ("v5_attention_bias", "attention_bias"),
            ("v5_mlp_bias", "mlp_bias"),
            ("v5_gelu", "hidden_act"),
            ("v5_dropout", "attention_dropout"),
        ] {
            let error = fixture(name).unwrap_err();
            assert!(error.contains(words), "{name}: {error}");
        }
    }

    #[test]
    fn written_configs_read_back_in_either_layout() {
        for scaling in [
            RopeScaling::Default,
            RopeScaling::Linear { factor: 2.0 },
            LLAMA3,
        ] {
            let config = tiny(500_000.0, scaling).with_tie_word_embeddings(scaling == LLAMA3);
            let written = hf_config(&config);
            assert_eq!(parse_hf_config(&written), Ok(config.clone()));
            // What transformers 4 reads, and what transformers 5 reads, each alone.
            for drop in ["rope_parameters", "rope_scaling"] {
                let mut alone = written.clone();
                alone.as_object_mut().unwrap().remove(drop);
                if drop == "rope_scaling" {
                    alone.as_object_mut().unwrap().remove("rope_theta");
                }
                assert_eq!(
                    parse_hf_config(&alone),
                    Ok(config.clone()),
                    "without {drop}"
                );
            }
        }
    }

    #[test]
    fn layouts_that_disagree_or_say_too_much_are_refused() {
        let refused = |edit: &dyn Fn(&mut Map<String, Value>)| {
            let mut json = hf_config(&tiny(500_000.0, LLAMA3));
            edit(json.as_object_mut().unwrap());
            parse_hf_config(&json).unwrap_err()
        };
        let error = refused(&|c| {
            c["rope_parameters"]["factor"] = json!(16.0);
        });
        assert!(error.contains("disagree"), "{error}");
        let error = refused(&|c| {
            c["rope_parameters"]["rope_theta"] = json!(10000.0);
        });
        assert!(error.contains("rope_theta 500000"), "{error}");
        let error = refused(&|c| {
            c["rope_scaling"]["beta_fast"] = json!(32.0);
        });
        assert!(error.contains("`beta_fast`"), "{error}");
        let error = refused(&|c| {
            c["rope_scaling"]["type"] = json!("linear");
        });
        assert!(error.contains("two rotary types"), "{error}");
        let error = refused(&|c| {
            c.remove("rope_scaling");
            c["rope_parameters"]
                .as_object_mut()
                .unwrap()
                .remove("high_freq_factor");
        });
        assert!(error.contains("no `high_freq_factor`"), "{error}");
        let error = refused(&|c| {
            c["rms_norm_eps"] = json!("small");
        });
        assert!(error.contains("not a number"), "{error}");
        let error = refused(&|c| {
            c["model_type"] = json!("mistral");
        });
        assert!(error.contains("mistral"), "{error}");
        let error = refused(&|c| {
            c["rope_theta"] = json!(-1.0);
            c.remove("rope_parameters");
        });
        assert!(
            error.contains("rope_theta must be finite and positive"),
            "{error}"
        );
    }

    /// `json` as transformers 5 writes it (rope_parameters only), with no
    /// original_max_position_embeddings in it.
    fn drop_original_context(json: &mut Value) {
        let config = json.as_object_mut().unwrap();
        config.remove("rope_scaling");
        config["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("original_max_position_embeddings");
    }

    #[test]
    fn a_top_level_original_context_is_read_and_must_agree() {
        // transformers 5 prefers the top level (Phi-3 writes it there); 4 reads the dict.
        let mut json = hf_config(&tiny(500_000.0, LLAMA3));
        json["original_max_position_embeddings"] = json!(64);
        assert_eq!(parse_hf_config(&json), Ok(tiny(500_000.0, LLAMA3)));
        json["original_max_position_embeddings"] = json!(128);
        let error = parse_hf_config(&json).unwrap_err();
        assert!(error.contains("make them agree"), "{error}");
        // With none in the rotary settings, the top level's.
        drop_original_context(&mut json);
        let parsed = parse_hf_config(&json).unwrap();
        assert!(
            matches!(
                parsed.rope_scaling,
                RopeScaling::Llama3 {
                    original_max_position_embeddings: 128,
                    ..
                }
            ),
            "{:?}",
            parsed.rope_scaling
        );
        // No heads is refused, not a division by zero.
        json["num_attention_heads"] = json!(0);
        let error = parse_hf_config(&json).unwrap_err();
        assert!(error.contains("at least 1"), "{error}");
        json["num_attention_heads"] = json!(4);
        json["hidden_act"] = json!("swish");
        assert!(parse_hf_config(&json).is_ok());
    }

    #[test]
    fn a_missing_original_context_is_the_models_own() {
        let mut json = hf_config(&tiny(500_000.0, LLAMA3));
        drop_original_context(&mut json);
        let parsed = parse_hf_config(&json).unwrap();
        let RopeScaling::Llama3 {
            original_max_position_embeddings,
            ..
        } = parsed.rope_scaling
        else {
            panic!("{:?}", parsed.rope_scaling)
        };
        assert_eq!(original_max_position_embeddings, 256);
    }
}
