//! Model shapes: the presets and the arithmetic that follows from them.

use burn::config::Config;

use crate::rope::{Rope, RopeScaling};

/// Shape of a Llama-style decoder. Field names follow Hugging Face's `LlamaConfig`.
#[derive(Config, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU hidden layer.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Longest sequence the rotary tables are meant for.
    #[config(default = 2048)]
    pub max_position_embeddings: usize,
    /// Base of the rotary frequencies.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// How the rotary frequencies are scaled (Hugging Face's `rope_type`).
    #[config(default = "RopeScaling::Default")]
    pub rope_scaling: RopeScaling,
    /// Epsilon of RMSNorm.
    #[config(default = 1e-5)]
    pub rms_norm_eps: f64,
    /// Standard deviation of the normal initialisation of every matrix.
    #[config(default = 0.02)]
    pub initializer_range: f64,
    /// The head reads the embedding's weight (transposed) instead of a matrix of its own, as
    /// Llama 3.2 1B and 3B do.
    #[config(default = false)]
    pub tie_word_embeddings: bool,
}

/// The presets `--model` accepts.
pub const PRESETS: [&str; 4] = ["tiny", "small", "llama-1b", "llama-7b"];

impl LlamaConfig {
    /// A preset by name: `tiny` (~1M parameters, tests), `small` (~25M, CPU runs), `llama-1b`
    /// (Llama 3.2 1B's shape) and `llama-7b` (Llama 2 7B's shape).
    pub fn preset(name: &str) -> Option<Self> {
        let config = match name {
            "tiny" => Self::new(256, 128, 512, 4, 4, 2).with_max_position_embeddings(256),
            "small" => Self::new(256, 512, 1408, 8, 8, 4).with_max_position_embeddings(1024),
            "llama-1b" => Self::new(128_256, 2048, 8192, 16, 32, 8)
                .with_max_position_embeddings(131_072)
                .with_rope_theta(500_000.0)
                .with_rope_scaling(RopeScaling::Llama3 {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }),
            "llama-7b" => Self::new(32_000, 4096, 11_008, 32, 32, 32)
                .with_max_position_embeddings(4096)
                .with_rms_norm_eps(1e-6),
            _ => return None,
        };
        Some(config)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The rotary settings.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_theta,
            scaling: self.rope_scaling,
        }
    }

    /// Checks that the shape can be built, with a sentence saying what to change.
    pub fn validate(&self) -> Result<(), String> {
        let (h, q, kv) = (
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
        );
        if self.vocab_size == 0 || h == 0 || self.intermediate_size == 0 || q == 0 || kv == 0 {
            return Err("every size of the model must be at least 1".into());
        }
        if h % q != 0 {
            return Err(format!(
                "hidden_size {h} does not divide by num_attention_heads {q}; pick a multiple of {q}"
            ));
        }
        if q % kv != 0 {
            return Err(format!(
                "num_attention_heads {q} does not divide by num_key_value_heads {kv}; pick a divisor of {q}"
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "the head width {} is odd, but rotary embeddings rotate pairs; make hidden_size / num_attention_heads even",
                self.head_dim()
            ));
        }
        for (name, value) in [
            ("rope_theta", self.rope_theta),
            ("rms_norm_eps", self.rms_norm_eps),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!("{name} must be finite and positive, not {value}"));
            }
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return Err(format!(
                "initializer_range must be finite and not negative, not {}",
                self.initializer_range
            ));
        }
        self.rope_scaling.validate()
    }

    /// Parameters of the model: embedding, blocks, final norm and head (none of its own when
    /// tied).
    pub fn num_params(&self) -> usize {
        let (v, h, f) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let attention = 2 * h * h + 2 * h * kv;
        let block = attention + 3 * h * f + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + head + self.num_hidden_layers * block + h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_advertised_size() {
        let count = |name| LlamaConfig::preset(name).unwrap().num_params();
        assert!((0.9e6..1.2e6).contains(&(count("tiny") as f64)));
        assert!((20e6..30e6).contains(&(count("small") as f64)));
        // Published totals: Llama 3.2 1B has 1.24B with tied embeddings (+0.26B untied),
        // Llama 2 7B has 6.74B.
        assert_eq!(count("llama-7b"), 6_738_415_616);
        assert_eq!(count("llama-1b"), 1_498_482_688);
        let tied = LlamaConfig::preset("llama-1b")
            .unwrap()
            .with_tie_word_embeddings(true);
        assert_eq!(
            tied.num_params(),
            1_235_814_400,
            "Llama 3.2 1B's published 1.24B"
        );
        for name in PRESETS {
            LlamaConfig::preset(name).unwrap().validate().unwrap();
        }
    }
}
