//! Rotary position embeddings in Hugging Face's rotate-half layout: a head's first half holds
//! the real parts and its second half the imaginary parts, so Hugging Face checkpoints load
//! without permuting the query and key weights. The frequencies may be scaled for contexts
//! longer than the model was first trained on, as Hugging Face's `rope_type` says.

use std::f64::consts::PI;

use burn::tensor::{Tensor, TensorData, backend::Backend};
use serde::{Deserialize, Serialize};

/// The rotary settings of a model: the base of its frequencies and how they are scaled.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    /// Base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// How the frequencies are scaled.
    pub scaling: RopeScaling,
}

/// How the rotary frequencies are scaled (Hugging Face's `rope_type` and its parameters).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain rotary positions (`default`).
    #[default]
    Default,
    /// Every frequency divided by `factor` (`linear`, position interpolation).
    Linear {
        /// What the frequencies are divided by.
        factor: f64,
    },
    /// Llama 3.1's bands (`llama3`): wavelengths shorter than
    /// `original_max_position_embeddings / high_freq_factor` are kept, those longer than
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, and those
    /// between move smoothly from one to the other.
    Llama3 {
        /// What the low frequencies are divided by.
        factor: f64,
        /// Sets the longest wavelength still (partly) kept.
        low_freq_factor: f64,
        /// Sets the shortest wavelength already (partly) scaled.
        high_freq_factor: f64,
        /// The context the model was first trained on.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// Hugging Face's name of this scaling (`rope_type`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Linear { .. } => "linear",
            Self::Llama3 { .. } => "llama3",
        }
    }

    /// Checks that the parameters give finite, positive frequencies, with a sentence saying
    /// what to change.
    pub fn validate(&self) -> Result<(), String> {
        let positive = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "the {} rotary scaling needs a finite, positive {name}, not {value}",
                    self.name()
                ))
            }
        };
        match *self {
            Self::Default => Ok(()),
            Self::Linear { factor } => positive("factor", factor),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if original_max_position_embeddings == 0 {
                    return Err(
                        "the llama3 rotary scaling needs original_max_position_embeddings of at least 1"
                            .into(),
                    );
                }
                if high_freq_factor <= low_freq_factor {
                    return Err(format!(
                        "the llama3 rotary scaling needs high_freq_factor above low_freq_factor, not {high_freq_factor} <= {low_freq_factor}"
                    ));
                }
                Ok(())
            }
        }
    }

    /// The frequency `inverse_frequency` (radians per position) once scaled.
    fn scale(&self, inverse_frequency: f64) -> f64 {
        match *self {
            Self::Default => inverse_frequency,
            Self::Linear { factor } => inverse_frequency / factor,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let context = original_max_position_embeddings as f64;
                let wavelength = 2.0 * PI / inverse_frequency;
                if wavelength < context / high_freq_factor {
                    inverse_frequency
                } else if wavelength > context / low_freq_factor {
                    inverse_frequency / factor
                } else {
                    let smooth = (context / wavelength - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inverse_frequency / factor + smooth * inverse_frequency
                }
            }
        }
    }
}

impl Rope {
    /// The `head_dim / 2` frequencies (radians per position) of a head's pairs.
    pub fn frequencies(&self, head_dim: usize) -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let plain = self.theta.powf(-2.0 * i as f64 / head_dim as f64);
                self.scaling.scale(plain)
            })
            .collect()
    }
}

/// `cos` and `sin` tables of shape `[1, 1, seq_len, head_dim]`, both halves repeating the
/// frequencies (Hugging Face's `cat(freqs, freqs)`).
pub fn tables<B: Backend>(
    seq_len: usize,
    head_dim: usize,
    rope: &Rope,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    tables_at::<B>(0..seq_len, head_dim, rope, device)
}

/// The rows of [`tables`] at `positions`, in their order: a context-parallel rank's tokens
/// rotate by their places in the whole sequence.
pub fn tables_at<B: Backend>(
    positions: impl ExactSizeIterator<Item = usize>,
    head_dim: usize,
    rope: &Rope,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let half = head_dim / 2;
    let frequencies = rope.frequencies(head_dim);
    let rows = positions.len();
    let mut cos = Vec::with_capacity(rows * head_dim);
    let mut sin = Vec::with_capacity(rows * head_dim);
    for position in positions {
        for i in 0..head_dim {
            let angle = position as f64 * frequencies[i % half];
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let shape = [1, 1, rows, head_dim];
    (
        Tensor::from_data(TensorData::new(cos, shape), device),
        Tensor::from_data(TensorData::new(sin, shape), device),
    )
}

/// Rotates `x` (`[batch, heads, seq, head_dim]`) by its position: `x cos + rotate_half(x) sin`.
pub fn apply<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let [_, _, _, head_dim] = x.dims();
    let half = head_dim / 2;
    let first = x.clone().narrow(3, 0, half);
    let second = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![second.neg(), first], 3);
    x * cos.clone() + rotated * sin.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn rotation_keeps_norms_and_matches_complex_multiplication() {
        let device = Default::default();
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::Default,
        };
        let (cos, sin) = tables::<Flex>(3, 4, &rope, &device);
        // One head of width 4: pairs (x0, x2) and (x1, x3) are complex numbers.
        let x = Tensor::<Flex, 4>::from_floats([[[[1.0, 2.0, 3.0, 4.0]; 3]]], &device);
        let y: Vec<f32> = apply(x, &cos, &sin).into_data().to_vec().unwrap();
        for position in 0..3 {
            for (pair, frequency) in [(0, 1.0f64), (1, 0.01)] {
                let angle = position as f64 * frequency;
                let (re, im) = ([1.0, 2.0][pair], [3.0, 4.0][pair]);
                let want_re = re * angle.cos() - im * angle.sin();
                let want_im = re * angle.sin() + im * angle.cos();
                let got_re = y[position * 4 + pair] as f64;
                let got_im = y[position * 4 + pair + 2] as f64;
                assert!((got_re - want_re).abs() < 1e-5 && (got_im - want_im).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_divides_low_and_blends_between() {
        // Llama 3.1's parameters, on a head wide enough to reach all three bands.
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = Rope {
            theta: 500_000.0,
            scaling: RopeScaling::Default,
        };
        let scaled = Rope { scaling, ..plain };
        let (plain, scaled) = (plain.frequencies(128), scaled.frequencies(128));
        let mut bands = [0; 3];
        for (&p, &s) in plain.iter().zip(&scaled) {
            let wavelength = 2.0 * PI / p;
            if wavelength < 2048.0 {
                assert_eq!(s, p);
                bands[0] += 1;
            } else if wavelength > 8192.0 {
                assert_eq!(s, p / 8.0);
                bands[2] += 1;
            } else {
                // Between the two, and continuous at the ends of the band.
                assert!(p / 8.0 < s && s < p, "{s} not within ({}, {p})", p / 8.0);
                bands[1] += 1;
            }
        }
        assert!(bands.iter().all(|&n| n > 0), "bands {bands:?}");
        // Inside the blended band the value itself: transformers' formula evaluated in f64
        // (wavelength 3619.2, smooth factor 0.4212).
        let want = 0.000_856_751_412_919_632_1;
        assert!((scaled[31] - want).abs() <= 1e-12 * want, "{}", scaled[31]);
        let linear = Rope {
            theta: 500_000.0,
            scaling: RopeScaling::Linear { factor: 2.0 },
        };
        assert_eq!(linear.frequencies(128)[5], plain[5] / 2.0);
    }

    #[test]
    fn bad_scaling_parameters_are_refused() {
        let llama3 = |low, high| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: 64,
        };
        assert!(llama3(1.0, 4.0).validate().is_ok());
        assert!(
            llama3(4.0, 4.0)
                .validate()
                .unwrap_err()
                .contains("high_freq_factor")
        );
        assert!(llama3(f64::NAN, 4.0).validate().is_err());
        let linear = RopeScaling::Linear { factor: 0.0 };
        assert!(linear.validate().unwrap_err().contains("positive factor"));
    }
}
