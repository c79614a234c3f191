//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

/// Linear warmup over `warmup` steps to `peak`, then cosine decay to `peak * min_ratio` at
/// step `total - 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    /// Highest rate, reached at the end of warmup.
    pub peak: f64,
    /// Steps of linear warmup.
    pub warmup: usize,
    /// Steps in the run.
    pub total: usize,
    /// Final rate over peak.
    pub min_ratio: f64,
}

impl WarmupCosine {
    /// The rate for `step` (from 0).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let decay_steps = self.total.saturating_sub(self.warmup + 1).max(1);
        let progress = ((step - self.warmup) as f64 / decay_steps as f64).min(1.0);
        let floor = self.peak * self.min_ratio;
        floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_to_the_floor() {
        let s = WarmupCosine {
            peak: 1.0,
            warmup: 4,
            total: 14,
            min_ratio: 0.1,
        };
        assert_eq!(s.lr(0), 0.25);
        assert_eq!(s.lr(3), 1.0);
        assert_eq!(s.lr(4), 1.0);
        assert!((s.lr(13) - 0.1).abs() < 1e-12);
        assert!(s.lr(8) < s.lr(6) && s.lr(8) > 0.1);
    }
}
