//! Cutting a list of layers into contiguous stages of balanced cost (parameter count or
//! measured time): the stage that costs most sets the pace of the whole pipeline.

use std::ops::Range;

use crate::PipelineError;

/// Splits layers costing `costs` into `stages` contiguous, non-empty ranges so that the most
/// expensive stage is as cheap as possible. The first stage also carries `first_extra` (the
/// embedding) and the last `last_extra` (final norm, head and loss), so they get fewer layers
/// when those are heavy. Among equally good splits, earlier stages take fewer layers.
pub fn balance(
    costs: &[f64],
    stages: usize,
    first_extra: f64,
    last_extra: f64,
) -> Result<Vec<Range<usize>>, PipelineError> {
    let n = costs.len();
    if stages == 0 {
        return Err(PipelineError::Config(
            "a pipeline needs at least one stage".into(),
        ));
    }
    if stages > n {
        return Err(PipelineError::Config(format!(
            "{n} layer(s) cannot fill {stages} stages: every stage needs at least one layer"
        )));
    }
    if let Some(bad) = costs
        .iter()
        .chain([&first_extra, &last_extra])
        .find(|c| !c.is_finite() || **c < 0.0)
    {
        return Err(PipelineError::Config(format!(
            "layer costs must be finite and not negative, got {bad}"
        )));
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |sum, c| {
            *sum += c;
            Some(*sum)
        }))
        .collect();
    let cost = |stage: usize, range: Range<usize>| {
        let mut c = prefix[range.end] - prefix[range.start];
        if stage == 0 {
            c += first_extra;
        }
        if stage == stages - 1 {
            c += last_extra;
        }
        c
    };
    // best[k][i]: the cheapest slowest stage when the first k stages hold layers 0..i;
    // cut[k][i]: where the k-th of those stages starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for i in k..=n - (stages - k) {
            for j in k - 1..i {
                let candidate = best[k - 1][j].max(cost(k - 1, j..i));
                if candidate < best[k][i] {
                    best[k][i] = candidate;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = cut[k][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_layers_split_evenly() {
        let ranges = balance(&[1.0; 8], 4, 0.0, 0.0).unwrap();
        assert_eq!(ranges, vec![0..2, 2..4, 4..6, 6..8]);
    }

    #[test]
    fn heavy_ends_take_fewer_layers() {
        // The embedding and the head each weigh two layers.
        let ranges = balance(&[1.0; 8], 2, 2.0, 2.0).unwrap();
        assert_eq!(ranges, vec![0..4, 4..8]);
        let ranges = balance(&[1.0; 6], 2, 3.0, 0.0).unwrap();
        assert_eq!(ranges, vec![0..1, 1..6]);
        let ranges = balance(&[1.0, 1.0, 4.0, 1.0, 1.0, 1.0], 3, 0.0, 0.0).unwrap();
        assert_eq!(ranges, vec![0..2, 2..3, 3..6]);
    }

    #[test]
    fn impossible_splits_say_why() {
        let error = balance(&[1.0; 3], 4, 0.0, 0.0).unwrap_err().to_string();
        assert!(error.contains("3 layer(s) cannot fill 4 stages"), "{error}");
        assert!(balance(&[1.0, f64::NAN], 1, 0.0, 0.0).is_err());
        assert!(balance(&[1.0], 0, 0.0, 0.0).is_err());
    }
}
