//! Learning rate for a k-times larger batch: the linear scaling rule with gradual warmup
//! (Goyal et al., 2017, "Accurate, Large Minibatch SGD").

/// Scales a learning rate tuned for `base_batch` samples to `batch` samples, reaching the
/// scaled rate linearly over `warmup_steps` from the base rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearScaling {
    /// Learning rate tuned at `base_batch`.
    pub base_lr: f64,
    /// Batch size the base rate was tuned for.
    pub base_batch: usize,
    /// Steps to ramp from `base_lr` to the scaled rate.
    pub warmup_steps: usize,
}

impl LinearScaling {
    /// The rate after warmup for a global batch of `batch`: `base_lr * batch / base_batch`.
    pub fn scaled_lr(&self, batch: usize) -> f64 {
        self.base_lr * batch as f64 / self.base_batch as f64
    }

    /// The rate at `step` (from 0) for a global batch of `batch`.
    pub fn lr(&self, step: usize, batch: usize) -> f64 {
        let target = self.scaled_lr(batch);
        if step >= self.warmup_steps {
            return target;
        }
        let progress = step as f64 / self.warmup_steps as f64;
        self.base_lr + (target - self.base_lr) * progress
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_from_base_to_k_times_base() {
        let rule = LinearScaling {
            base_lr: 0.1,
            base_batch: 256,
            warmup_steps: 4,
        };
        assert_eq!(rule.scaled_lr(1024), 0.4);
        assert_eq!(rule.lr(0, 1024), 0.1);
        assert!((rule.lr(2, 1024) - 0.25).abs() < 1e-12);
        assert_eq!(rule.lr(4, 1024), 0.4);
        assert_eq!(rule.lr(100, 256), 0.1);
    }
}
