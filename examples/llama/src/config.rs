//! Model shapes: the presets and the arithmetic that follows from them.

use burn::config::Config;
use burn_expert_parallel::RouterConfig;

use crate::rope::{Rope, RopeScaling};

/// Shape of a Llama-style decoder. Field names follow Hugging Face's `LlamaConfig`.
#[derive(Config, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU hidden layer (of each expert's, in a mixture of experts).
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
    /// Experts in each block's mixture of experts, which replaces its MLP (Mixtral's name);
    /// 0: a dense MLP.
    #[config(default = 0)]
    pub num_local_experts: usize,
    /// Experts each token is routed to.
    #[config(default = 2)]
    pub num_experts_per_tok: usize,
    /// Weight of the Switch/GShard load-balancing loss (per block).
    #[config(default = 0.01)]
    pub router_aux_loss_coef: f64,
    /// Weight of the router z-loss (ST-MoE; per block); 0 turns it off.
    #[config(default = 0.0)]
    pub router_z_loss_coef: f64,
    /// Each expert takes at most `factor * tokens * top-k / experts` copies of a rank's
    /// tokens, dropping the rest (Megatron's capacity factor); none: dropless.
    #[config(default = "None")]
    pub expert_capacity_factor: Option<f64>,
}

/// The presets `--model` accepts.
pub const PRESETS: [&str; 9] = [
    "tiny",
    "small",
    "tiny-moe",
    "small-moe",
    "llama-1b",
    "llama-7b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
];

impl LlamaConfig {
    /// A preset by name: `tiny` (~1M parameters, tests), `small` (~25M, CPU runs), their
    /// mixtures of experts `tiny-moe` and `small-moe` (8 experts, top-2, each a quarter of the
    /// dense MLP, so a token uses half its MLP's weights), `llama-1b` (Llama 3.2 1B's shape)
    /// `llama-7b` (Llama 2 7B's shape) and Llama 3.1's `llama3-8b`, `llama3-70b` and
    /// `llama3-405b` (for `llama plan`; too large to train on a CPU).
    pub fn preset(name: &str) -> Option<Self> {
        let llama3 = |vocab, hidden, ffn, layers, heads| {
            Self::new(vocab, hidden, ffn, layers, heads, 8)
                .with_max_position_embeddings(131_072)
                .with_rope_theta(500_000.0)
                .with_rope_scaling(RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                })
        };
        let config = match name {
            "tiny" => Self::new(256, 128, 512, 4, 4, 2).with_max_position_embeddings(256),
            "small" => Self::new(256, 512, 1408, 8, 8, 4).with_max_position_embeddings(1024),
            "tiny-moe" => Self::new(256, 128, 128, 4, 4, 2)
                .with_max_position_embeddings(256)
                .with_num_local_experts(8),
            "small-moe" => Self::new(256, 512, 352, 8, 8, 4)
                .with_max_position_embeddings(1024)
                .with_num_local_experts(8),
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
            "llama3-8b" => llama3(128_256, 4096, 14_336, 32, 32),
            "llama3-70b" => llama3(128_256, 8192, 28_672, 80, 64),
            "llama3-405b" => llama3(128_256, 16_384, 53_248, 126, 128),
            _ => return None,
        };
        Some(config)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Whether `other` is this model's shape, whatever its routers' training settings (their
    /// losses' weights and capacity, which a run may change).
    pub fn same_model(&self, other: &Self) -> bool {
        let training = |c: &Self| {
            c.clone()
                .with_router_aux_loss_coef(0.0)
                .with_router_z_loss_coef(0.0)
                .with_expert_capacity_factor(None)
        };
        training(self) == training(other)
    }

    /// Whether each block's MLP is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.num_local_experts > 0
    }

    /// The router of each block's mixture of experts.
    pub fn router(&self) -> RouterConfig {
        RouterConfig {
            experts: self.num_local_experts,
            top_k: self.num_experts_per_tok,
            aux_loss_coeff: self.router_aux_loss_coef,
            z_loss_coeff: self.router_z_loss_coef,
            capacity_factor: self.expert_capacity_factor,
            normalize_top_k: true,
        }
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
        if self.is_moe() {
            self.router().validate().map_err(|e| {
                format!(
                    "num_local_experts {}, num_experts_per_tok {}: {e}",
                    self.num_local_experts, self.num_experts_per_tok
                )
            })?;
        }
        self.rope_scaling.validate()
    }

    /// Parameters of the model: embedding, blocks, final norm and head (none of its own when
    /// tied).
    pub fn num_params(&self) -> usize {
        self.params_using(self.num_local_experts)
    }

    /// Parameters a token's forward uses: [`num_params`](Self::num_params) with only its
    /// `num_experts_per_tok` experts of each block (and the router).
    pub fn num_active_params(&self) -> usize {
        self.params_using(self.num_experts_per_tok.min(self.num_local_experts))
    }

    /// Parameters of every block's experts (none in a dense model).
    pub fn num_expert_params(&self) -> usize {
        match self.is_moe() {
            false => 0,
            true => self.num_local_experts * self.expert_params() * self.num_hidden_layers,
        }
    }

    /// Parameters of one expert (or of the dense MLP): a SwiGLU's three matrices.
    fn expert_params(&self) -> usize {
        3 * self.hidden_size * self.intermediate_size
    }

    /// The parameter count with `experts` experts per block (the router's counted whole).
    fn params_using(&self, experts: usize) -> usize {
        let (v, h) = (self.vocab_size, self.hidden_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let attention = 2 * h * h + 2 * h * kv;
        let mlp = match self.is_moe() {
            false => self.expert_params(),
            true => h * self.num_local_experts + experts * self.expert_params(),
        };
        let block = attention + mlp + 2 * h;
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
        // Llama 3.1's model cards: 8.03B, 70.6B, 406B parameters.
        for (name, params) in [
            ("llama3-8b", 8_030_261_248),
            ("llama3-70b", 70_553_706_496),
            ("llama3-405b", 405_853_388_800),
        ] {
            assert_eq!(
                LlamaConfig::preset(name).unwrap().num_params(),
                params,
                "{name}"
            );
        }
        // 8 experts of a quarter of the dense MLP, 2 per token: half its MLP weights active.
        for (dense, moe) in [("tiny", "tiny-moe"), ("small", "small-moe")] {
            let (dense, moe) = (
                LlamaConfig::preset(dense).unwrap(),
                LlamaConfig::preset(moe).unwrap(),
            );
            let (h, layers) = (moe.hidden_size, moe.num_hidden_layers);
            let dense_mlp = 3 * h * dense.intermediate_size * layers;
            let router = h * 8 * layers;
            assert_eq!(moe.num_params(), dense.num_params() + dense_mlp + router);
            assert_eq!(
                moe.num_active_params(),
                dense.num_params() - dense_mlp / 2 + router
            );
        }
    }

    #[test]
    fn a_router_that_cannot_work_is_refused() {
        let bad = LlamaConfig::preset("tiny-moe")
            .unwrap()
            .with_num_experts_per_tok(9);
        let error = bad.validate().unwrap_err();
        assert!(error.contains("top-9 of 8 experts"), "{error}");
    }
}
