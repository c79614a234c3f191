//! Rotary position embeddings in Hugging Face's rotate-half layout: a head's first half holds
//! the real parts and its second half the imaginary parts, so Hugging Face checkpoints load
//! without permuting the query and key weights.

use burn::tensor::{Tensor, TensorData, backend::Backend};

/// `cos` and `sin` tables of shape `[1, 1, seq_len, head_dim]`, both halves repeating the
/// frequencies (Hugging Face's `cat(freqs, freqs)`).
pub fn tables<B: Backend>(
    seq_len: usize,
    head_dim: usize,
    theta: f64,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(seq_len * head_dim);
    let mut sin = Vec::with_capacity(seq_len * head_dim);
    for position in 0..seq_len {
        for i in 0..head_dim {
            let frequency = theta.powf(-2.0 * (i % half) as f64 / head_dim as f64);
            let angle = position as f64 * frequency;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let shape = [1, 1, seq_len, head_dim];
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
        let (cos, sin) = tables::<Flex>(3, 4, 10000.0, &device);
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
}
