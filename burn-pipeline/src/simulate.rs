//! Replaying a schedule on paper: when each action starts and ends given what it costs, the
//! bubble, and the activations each rank holds. The executor's measured timelines are the same
//! [`Timeline`], so simulated and measured bubbles are computed by the same code.

use serde::Serialize;

use crate::PipelineError;
use crate::schedule::{Action, ActionTable, Kind, Schedule};

/// What the actions of one rank's whole share of the model cost; a chunk of an interleaved
/// schedule costs `1 / virtual_stages` of it. A whole backward costs both halves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Costs {
    /// Forward.
    pub forward: f64,
    /// Gradient of the input.
    pub backward_input: f64,
    /// Gradients of the weights.
    pub backward_weight: f64,
    /// One send between ranks (a receive costs nothing but waiting).
    pub send: f64,
}

impl Costs {
    /// The zero-bubble paper's unit costs: forward and each backward half 1, sends free.
    pub const UNIT: Costs = Costs {
        forward: 1.0,
        backward_input: 1.0,
        backward_weight: 1.0,
        send: 0.0,
    };

    fn of(&self, kind: Kind, virtual_stages: usize) -> f64 {
        let chunk = 1.0 / virtual_stages as f64;
        match kind {
            Kind::Forward => self.forward * chunk,
            Kind::Backward => (self.backward_input + self.backward_weight) * chunk,
            Kind::BackwardInput => self.backward_input * chunk,
            Kind::BackwardWeight => self.backward_weight * chunk,
            Kind::SendForward | Kind::SendBackward => self.send,
            Kind::RecvForward | Kind::RecvBackward => 0.0,
        }
    }
}

/// One action's place in time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Span {
    /// The action.
    pub action: Action,
    /// When it started (a receive: when the rank began waiting).
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// Every rank's spans in one step, simulated or measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    /// `ranks[r]`: rank `r`'s spans in order.
    pub ranks: Vec<Vec<Span>>,
    /// Chunks per rank: a chunk's activations are `1 / virtual_stages` of a rank's share.
    pub virtual_stages: usize,
}

impl Timeline {
    /// From the first start to the last end, over all ranks.
    pub fn makespan(&self) -> f64 {
        let spans = || self.ranks.iter().flatten();
        let first = spans().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let last = spans().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
        if first.is_finite() { last - first } else { 0.0 }
    }

    /// Time `rank` spent on model work.
    pub fn busy(&self, rank: usize) -> f64 {
        self.ranks[rank]
            .iter()
            .filter(|s| s.action.kind.is_compute())
            .map(|s| s.end - s.start)
            .sum()
    }

    /// The share of the ranks' time not spent on model work: idle, waiting or communicating.
    pub fn bubble(&self) -> f64 {
        let total = self.makespan() * self.ranks.len() as f64;
        if total == 0.0 {
            return 0.0;
        }
        let busy: f64 = (0..self.ranks.len()).map(|r| self.busy(r)).sum();
        1.0 - busy / total
    }

    /// For each rank, the most micro-batches whose activations it held at once, in units of
    /// its whole share of the model: a (micro-batch, chunk) is held from the start of its
    /// forward to the end of its backward, or of its input half for zero-bubble, after which
    /// the executor keeps only the stage's input and output gradient for the weight half.
    pub fn peak_activations(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|spans| {
                let mut events: Vec<(f64, i32)> = Vec::new();
                for span in spans {
                    match span.action.kind {
                        Kind::Forward => events.push((span.start, 1)),
                        Kind::Backward | Kind::BackwardInput => events.push((span.end, -1)),
                        _ => {}
                    }
                }
                // At one instant, what ends frees before what starts takes.
                events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                let (mut held, mut peak) = (0i32, 0i32);
                for (_, change) in events {
                    held += change;
                    peak = peak.max(held);
                }
                peak as f64 / self.virtual_stages as f64
            })
            .collect()
    }
}

/// Replays `schedule` with the given costs: every action starts as soon as its rank is free and
/// what it needs is done. Sends are buffered, so they never wait for their receiver.
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Timeline, PipelineError> {
    schedule.validate()?;
    replay(schedule, costs)
}

/// The replay behind both [`simulate`] and [`Schedule::validate`]'s deadlock check.
pub(crate) fn replay(schedule: &Schedule, costs: &Costs) -> Result<Timeline, PipelineError> {
    let stages = schedule.stages();
    let same_rank = |a: usize, b: usize| schedule.rank_of(a) == schedule.rank_of(b);
    // End times of what has run, by (kind, micro-batch, stage); a whole backward also counts
    // as its input half, which is what the previous stage waits for.
    let mut done: ActionTable<Option<f64>> = ActionTable::new(schedule, None);
    // What an action waits for: at most two earlier actions.
    let needs = |action: &Action| -> [Option<(Kind, usize, usize)>; 2] {
        let (mb, s) = (action.micro_batch, action.stage);
        let one = |kind, stage| [Some((kind, mb, stage)), None];
        match action.kind {
            Kind::Forward if s == 0 => [None, None],
            Kind::Forward if same_rank(s - 1, s) => one(Kind::Forward, s - 1),
            Kind::Forward => one(Kind::RecvForward, s),
            Kind::RecvForward => one(Kind::SendForward, s - 1),
            Kind::SendForward => one(Kind::Forward, s),
            Kind::Backward | Kind::BackwardInput if s + 1 == stages => one(Kind::Forward, s),
            Kind::Backward | Kind::BackwardInput if same_rank(s, s + 1) => [
                Some((Kind::Forward, mb, s)),
                Some((Kind::BackwardInput, mb, s + 1)),
            ],
            Kind::Backward | Kind::BackwardInput => [
                Some((Kind::Forward, mb, s)),
                Some((Kind::RecvBackward, mb, s)),
            ],
            Kind::RecvBackward => one(Kind::SendBackward, s + 1),
            Kind::SendBackward => one(Kind::BackwardInput, s),
            Kind::BackwardWeight => one(Kind::BackwardInput, s),
        }
    };
    let end_of = |done: &ActionTable<Option<f64>>, (kind, mb, stage): (Kind, usize, usize)| {
        *done.get(kind, mb, stage)
    };
    let ranks = schedule.ranks;
    let mut next = vec![0usize; ranks];
    let mut free = vec![0.0f64; ranks];
    let mut timeline = Timeline {
        ranks: vec![Vec::new(); ranks],
        virtual_stages: schedule.virtual_stages,
    };
    loop {
        let mut progressed = false;
        for rank in 0..ranks {
            while let Some(action) = schedule.actions[rank].get(next[rank]) {
                let mut ready = Some(0.0f64);
                for key in needs(action).into_iter().flatten() {
                    ready = ready.zip(end_of(&done, key)).map(|(a, b)| a.max(b));
                }
                let Some(ready) = ready else { break };
                let (start, end) = if matches!(action.kind, Kind::RecvForward | Kind::RecvBackward)
                {
                    (free[rank], free[rank].max(ready))
                } else {
                    let start = free[rank].max(ready);
                    (
                        start,
                        start + costs.of(action.kind, schedule.virtual_stages),
                    )
                };
                *done.get_mut(action.kind, action.micro_batch, action.stage) = Some(end);
                if action.kind == Kind::Backward {
                    *done.get_mut(Kind::BackwardInput, action.micro_batch, action.stage) =
                        Some(end);
                }
                timeline.ranks[rank].push(Span {
                    action: *action,
                    start,
                    end,
                });
                free[rank] = end;
                next[rank] += 1;
                progressed = true;
            }
        }
        if (0..ranks).all(|r| next[r] == schedule.actions[r].len()) {
            return Ok(timeline);
        }
        if !progressed {
            let waits: Vec<String> = (0..ranks)
                .filter_map(|r| {
                    let action = schedule.actions[r].get(next[r])?;
                    let missing: Vec<String> = needs(action)
                        .into_iter()
                        .flatten()
                        .filter(|&k| end_of(&done, k).is_none())
                        .map(|(kind, mb, stage)| {
                            let on = schedule.rank_of(stage);
                            format!(
                                "the {} (rank {on})",
                                Action {
                                    kind,
                                    micro_batch: mb,
                                    stage
                                }
                            )
                        })
                        .collect();
                    Some(format!(
                        "rank {r} waits at the {action} for {}",
                        missing.join(" and ")
                    ))
                })
                .collect();
            return Err(PipelineError::Schedule(format!(
                "deadlock: no rank can go on; {}",
                waits.join("; ")
            )));
        }
    }
}
