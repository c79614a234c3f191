//! A step's measured timeline, gathered from the ranks that ran it: each rank times only its
//! own actions, and ranks that are processes share no memory, so one of them draws the whole
//! step only once every rank's spans have come to it.

use burn_comm::Communicator;
use serde::{Deserialize, Serialize};

use crate::PipelineError;
use crate::schedule::Action;
use crate::simulate::{Span, Timeline};

/// A span as it travels: its times as their bits, since a float written as JSON text need not
/// read back the same.
#[derive(Serialize, Deserialize)]
struct SentSpan {
    action: Action,
    start: u64,
    end: u64,
}

impl Timeline {
    /// Every rank of `pipeline`'s `spans`, whole on its rank 0 (`None` on the others): rank `r`
    /// of the group is row `r` of the timeline. Every rank calls it, with spans timed from an
    /// origin the ranks share (the executor's, taken after a barrier). Chunks per rank are
    /// `virtual_stages`.
    pub fn gather(
        pipeline: &Communicator,
        spans: &[Span],
        virtual_stages: usize,
    ) -> Result<Option<Timeline>, PipelineError> {
        let sent: Vec<SentSpan> = spans
            .iter()
            .map(|s| SentSpan {
                action: s.action,
                start: s.start.to_bits(),
                end: s.end.to_bits(),
            })
            .collect();
        let mine = serde_json::to_vec(&sent).expect("spans serialise");
        let all = pipeline.all_gather_bytes(&mine)?;
        if pipeline.rank() != 0 {
            return Ok(None);
        }
        let ranks = all
            .iter()
            .map(|bytes| {
                let sent: Vec<SentSpan> =
                    serde_json::from_slice(bytes).expect("every rank sends its spans as these");
                sent.into_iter()
                    .map(|s| Span {
                        action: s.action,
                        start: f64::from_bits(s.start),
                        end: f64::from_bits(s.end),
                    })
                    .collect()
            })
            .collect();
        Ok(Some(Timeline {
            ranks,
            virtual_stages,
        }))
    }
}

#[cfg(test)]
mod tests {
    use burn_comm::launch;

    use crate::schedule::{Action, Kind};
    use crate::simulate::{Span, Timeline};

    #[test]
    fn rank_zero_gets_every_ranks_spans_in_rank_order() {
        let spans = |rank: usize| -> Vec<Span> {
            (0..rank + 1)
                .map(|i| Span {
                    action: Action {
                        kind: Kind::Forward,
                        micro_batch: i,
                        stage: rank,
                    },
                    // Not representable in few digits: must come back bit for bit.
                    start: i as f64 / 3.0 + rank as f64,
                    end: (i + 1) as f64 / 3.0 + rank as f64,
                })
                .collect()
        };
        let results = launch(3, |ctx| {
            Timeline::gather(ctx.world(), &spans(ctx.rank()), 2)
        });
        let mut results = results.into_iter().map(|r| r.expect("gathered"));
        let timeline = results.next().unwrap().expect("rank 0 holds the timeline");
        assert_eq!(
            timeline,
            Timeline {
                ranks: (0..3).map(spans).collect(),
                virtual_stages: 2
            }
        );
        assert!(results.all(|r| r.is_none()), "only rank 0 holds it");
    }
}
