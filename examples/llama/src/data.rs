//! Training data: a synthetic Markov source whose entropy rate is known exactly, so a run
//! knows the loss it should approach, and a user's file read as bytes or as a tokenizer's ids.
//!
//! A dataset is a list of samples of `seq_len + 1` tokens, addressed by index; which indices
//! each rank reads is the sampler's business (`burn_ddp::DistributedSampler`).

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tokenizer::TextTokenizer;

/// Samples of `seq_len + 1` tokens (inputs and the next-token targets) by index.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sample `index`: `seq_len + 1` token ids.
    fn sample(&self, index: usize) -> Vec<u32>;
    /// What the data is, for the run's header.
    fn describe(&self) -> String;
    /// The lowest mean cross-entropy a model can reach on this data, when it is known.
    fn loss_floor(&self) -> Option<f64>;
}

/// A second-order Markov chain over `alphabet` symbols in which each pair of previous symbols
/// allows `branching` next symbols with seeded random probabilities.
#[derive(Debug, Clone)]
pub struct MarkovSource {
    alphabet: usize,
    seq_len: usize,
    samples: usize,
    seed: u64,
    /// Per context `a * alphabet + b`: the allowed next symbols and their cumulative probabilities.
    next: Vec<Vec<(u32, f64)>>,
    /// Stationary distribution over contexts, cumulative, to draw each sample's first pair.
    start: Vec<f64>,
    entropy_rate: f64,
    first_step_entropy: f64,
}

impl MarkovSource {
    /// Builds the chain from `seed` and computes its stationary distribution and entropies.
    pub fn new(
        alphabet: usize,
        branching: usize,
        seq_len: usize,
        samples: usize,
        seed: u64,
    ) -> Self {
        assert!(alphabet >= 2 && branching >= 1 && branching <= alphabet);
        let mut rng = StdRng::seed_from_u64(seed);
        let contexts = alphabet * alphabet;
        let transitions: Vec<Vec<(u32, f64)>> = (0..contexts)
            .map(|_| {
                let mut symbols: Vec<u32> = (0..alphabet as u32).collect();
                for i in 0..branching {
                    let j = rng.random_range(i..alphabet);
                    symbols.swap(i, j);
                }
                let weights: Vec<f64> = (0..branching)
                    .map(|_| -rng.random_range(f64::EPSILON..1.0).ln())
                    .collect();
                let total: f64 = weights.iter().sum();
                symbols[..branching]
                    .iter()
                    .zip(weights)
                    .map(|(&s, w)| (s, w / total))
                    .collect()
            })
            .collect();

        // Stationary distribution over contexts by power iteration.
        let mut pi = vec![1.0 / contexts as f64; contexts];
        for _ in 0..10_000 {
            let mut next = vec![0.0; contexts];
            for (context, outs) in transitions.iter().enumerate() {
                let b = context % alphabet;
                for &(s, p) in outs {
                    next[b * alphabet + s as usize] += pi[context] * p;
                }
            }
            let change: f64 = next.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
            pi = next;
            if change < 1e-15 {
                break;
            }
        }
        let entropy = |ps: &mut dyn Iterator<Item = f64>| -> f64 {
            ps.filter(|&p| p > 0.0).map(|p| -p * p.ln()).sum()
        };
        let entropy_rate = transitions
            .iter()
            .zip(&pi)
            .map(|(outs, w)| w * entropy(&mut outs.iter().map(|o| o.1)))
            .sum();
        // The first target is predicted from one symbol only: H(X1 | X0) = H(X0, X1) - H(X0).
        let first: Vec<f64> = (0..alphabet)
            .map(|a| pi[a * alphabet..(a + 1) * alphabet].iter().sum())
            .collect();
        let first_step_entropy =
            entropy(&mut pi.iter().copied()) - entropy(&mut first.iter().copied());

        let next = transitions
            .into_iter()
            .map(|outs| {
                let mut acc = 0.0;
                outs.into_iter()
                    .map(|(s, p)| {
                        acc += p;
                        (s, acc)
                    })
                    .collect()
            })
            .collect();
        let start = pi
            .iter()
            .scan(0.0, |acc, p| {
                *acc += p;
                Some(*acc)
            })
            .collect();
        Self {
            alphabet,
            seq_len,
            samples,
            seed,
            next,
            start,
            entropy_rate,
            first_step_entropy,
        }
    }

    /// Entropy rate of the chain in nats per token: the loss floor far from a sequence's start.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }
}

fn draw(cumulative: impl IntoIterator<Item = f64>, u: f64) -> usize {
    let mut last = 0;
    for (i, c) in cumulative.into_iter().enumerate() {
        last = i;
        if u < c {
            return i;
        }
    }
    last
}

impl Dataset for MarkovSource {
    fn len(&self) -> usize {
        self.samples
    }

    fn sample(&self, index: usize) -> Vec<u32> {
        let mut rng =
            StdRng::seed_from_u64(self.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let context = draw(self.start.iter().copied(), rng.random());
        let mut tokens = vec![
            (context / self.alphabet) as u32,
            (context % self.alphabet) as u32,
        ];
        while tokens.len() < self.seq_len + 1 {
            let (a, b) = (tokens[tokens.len() - 2], tokens[tokens.len() - 1]);
            let outs = &self.next[a as usize * self.alphabet + b as usize];
            let pick = draw(outs.iter().map(|o| o.1), rng.random());
            tokens.push(outs[pick].0);
        }
        tokens.truncate(self.seq_len + 1);
        tokens
    }

    fn describe(&self) -> String {
        format!(
            "synthetic order-2 Markov source: {} symbols, {} samples of {} tokens, entropy rate {:.4} nats/token",
            self.alphabet,
            self.samples,
            self.seq_len + 1,
            self.entropy_rate
        )
    }

    /// The first target of a sample has only one symbol of context; every later one has two.
    fn loss_floor(&self) -> Option<f64> {
        let n = self.seq_len as f64;
        Some((self.first_step_entropy + (n - 1.0) * self.entropy_rate) / n)
    }
}

/// A user's file as one stream of tokens, its bytes (vocabulary 256) or its text's ids under
/// a tokenizer, cut into windows of `seq_len + 1` tokens that start every `seq_len`.
#[derive(Debug, Clone)]
pub struct TokenCorpus {
    tokens: Vec<u32>,
    seq_len: usize,
    /// The file, and what its tokens are.
    name: String,
    /// What one token is called in the run's header.
    unit: &'static str,
}

impl TokenCorpus {
    /// `path`'s bytes.
    pub fn bytes(path: &Path, seq_len: usize) -> Result<Self, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let tokens = bytes.into_iter().map(u32::from).collect();
        Self::new(tokens, seq_len, path.display().to_string(), "bytes")
    }

    /// `path`'s text as `tokenizer`'s ids, tokenized once and cached beside it.
    pub fn tokenized(
        path: &Path,
        tokenizer: &TextTokenizer,
        seq_len: usize,
    ) -> Result<Self, String> {
        let tokens = crate::token_cache::tokens(path, tokenizer)?;
        let name = format!("{} under {}", path.display(), tokenizer.path().display());
        Self::new(tokens, seq_len, name, "tokens")
    }

    fn new(
        tokens: Vec<u32>,
        seq_len: usize,
        name: String,
        unit: &'static str,
    ) -> Result<Self, String> {
        if tokens.len() < seq_len + 1 {
            return Err(format!(
                "{name} has {} {unit}, fewer than one sample of --seq-len {seq_len} + 1; use a longer file or a shorter --seq-len",
                tokens.len()
            ));
        }
        Ok(Self {
            tokens,
            seq_len,
            name,
            unit,
        })
    }
}

impl Dataset for TokenCorpus {
    fn len(&self) -> usize {
        (self.tokens.len() - 1) / self.seq_len
    }

    fn sample(&self, index: usize) -> Vec<u32> {
        let start = index * self.seq_len;
        self.tokens[start..start + self.seq_len + 1].to_vec()
    }

    fn describe(&self) -> String {
        format!(
            "{}: {} {unit}, {} samples of {} {unit}",
            self.name,
            self.tokens.len(),
            self.len(),
            self.seq_len + 1,
            unit = self.unit
        )
    }

    fn loss_floor(&self) -> Option<f64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markov_samples_are_reproducible_and_empirical_entropy_matches() {
        let source = MarkovSource::new(8, 3, 64, 1000, 3);
        assert_eq!(source.sample(5), source.sample(5));
        assert_ne!(source.sample(5), source.sample(6));
        // Empirical cross-entropy of the true model on fresh samples approaches the floor.
        let mut total = 0.0;
        let mut count = 0;
        for index in 0..1000 {
            let tokens = source.sample(index);
            for t in 2..tokens.len() {
                let outs = &source.next[tokens[t - 2] as usize * 8 + tokens[t - 1] as usize];
                let i = outs.iter().position(|o| o.0 == tokens[t]).unwrap();
                let p = outs[i].1 - if i == 0 { 0.0 } else { outs[i - 1].1 };
                total -= p.ln();
                count += 1;
            }
        }
        let empirical = total / count as f64;
        assert!(
            (empirical - source.entropy_rate()).abs() < 0.02,
            "{empirical}"
        );
    }

    #[test]
    fn corpus_windows_overlap_by_one() {
        let dir = std::env::temp_dir().join(format!("llama-bytes-{}", std::process::id()));
        std::fs::write(&dir, b"abcdefghij").unwrap();
        let corpus = TokenCorpus::bytes(&dir, 3).unwrap();
        assert_eq!(corpus.len(), 3);
        assert_eq!(
            corpus.sample(1),
            b"defg".iter().map(|&b| b as u32).collect::<Vec<_>>()
        );
        assert!(
            TokenCorpus::bytes(&dir, 20)
                .unwrap_err()
                .contains("shorter --seq-len")
        );
        std::fs::remove_file(dir).unwrap();
    }
}
