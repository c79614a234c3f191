//! A pipeline schedule as data: for every rank, the ordered list of what it does in one
//! training step. Pure builders make the classic schedules; [`Schedule::validate`] proves one
//! complete and deadlock-free before any model runs.
//!
//! The model is cut into `ranks x virtual_stages` stages. Stage `s` lives on rank
//! `s % ranks` (the interleaved placement of Narayanan et al., 2021); with one virtual stage
//! rank `r` holds stage `r`. An action names a micro-batch and a stage.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::PipelineError;

/// What one action does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Kind {
    /// Forward of the stage.
    Forward,
    /// Backward of the stage: the gradients of its input and of its weights together.
    Backward,
    /// Zero-bubble's first half of backward: the gradient of the stage's input only.
    BackwardInput,
    /// Zero-bubble's second half: the gradients of the stage's weights, off the critical path.
    BackwardWeight,
    /// Sends the stage's output to the rank of the next stage.
    SendForward,
    /// Receives the stage's input from the rank of the previous stage.
    RecvForward,
    /// Sends the gradient of the stage's input to the rank of the previous stage.
    SendBackward,
    /// Receives the gradient of the stage's output from the rank of the next stage.
    RecvBackward,
}

impl Kind {
    /// How many kinds there are (the last one's index, plus one).
    const COUNT: usize = Kind::RecvBackward as usize + 1;

    /// Whether this is model work (forward or a backward), as opposed to communication.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            Kind::Forward | Kind::Backward | Kind::BackwardInput | Kind::BackwardWeight
        )
    }

    /// The letter schedules are written with: F, B, I (input half), W (weight half), and
    /// lower-case s/r for sends and receives.
    pub fn letter(self) -> &'static str {
        match self {
            Kind::Forward => "F",
            Kind::Backward => "B",
            Kind::BackwardInput => "I",
            Kind::BackwardWeight => "W",
            Kind::SendForward => "sF",
            Kind::RecvForward => "rF",
            Kind::SendBackward => "sB",
            Kind::RecvBackward => "rB",
        }
    }
}

/// One step of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Action {
    /// What it does.
    pub kind: Kind,
    /// Which micro-batch.
    pub micro_batch: usize,
    /// Which stage (of `ranks x virtual_stages`).
    pub stage: usize,
}

impl Action {
    fn new(kind: Kind, micro_batch: usize, stage: usize) -> Self {
        Self {
            kind,
            micro_batch,
            stage,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            Kind::Forward => "forward",
            Kind::Backward => "backward",
            Kind::BackwardInput => "input-gradient backward",
            Kind::BackwardWeight => "weight-gradient backward",
            Kind::SendForward => "send of the output",
            Kind::RecvForward => "receive of the input",
            Kind::SendBackward => "send of the input gradient",
            Kind::RecvBackward => "receive of the output gradient",
        };
        write!(
            f,
            "{what} of micro-batch {} at stage {}",
            self.micro_batch, self.stage
        )
    }
}

/// The schedules this crate builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
pub enum ScheduleKind {
    /// GPipe (Huang et al., 2019): every forward, then every backward.
    #[value(name = "gpipe")]
    Gpipe,
    /// 1F1B (PipeDream-Flush, Narayanan et al., 2021): after a warm-up, one forward then one
    /// backward, so at most `ranks` micro-batches are in flight.
    #[value(name = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B (Narayanan et al., 2021): `virtual_stages` chunks per rank, which cuts
    /// the bubble by that factor.
    #[value(name = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1 (Qi et al., 2024): backward split into its input and weight halves,
    /// the weight halves moved into the bubble; the memory of 1F1B.
    #[value(name = "zb-h1")]
    ZeroBubbleH1,
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        })
    }
}

/// Every rank's actions for one training step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    /// Which builder made it.
    pub kind: ScheduleKind,
    /// Pipeline ranks.
    pub ranks: usize,
    /// Model chunks per rank.
    pub virtual_stages: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// `actions[rank]`, in the order the rank runs them.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// The schedule `kind` for `ranks` ranks and `micro_batches` micro-batches, with
    /// `virtual_stages` chunks per rank (1 for every kind but interleaved).
    pub fn new(
        kind: ScheduleKind,
        ranks: usize,
        micro_batches: usize,
        virtual_stages: usize,
    ) -> Result<Self, PipelineError> {
        if kind != ScheduleKind::Interleaved && virtual_stages != 1 {
            return Err(PipelineError::Config(format!(
                "{kind} runs one chunk per rank, not --virtual-stages {virtual_stages}; use --schedule interleaved for more"
            )));
        }
        match kind {
            ScheduleKind::Gpipe => gpipe(ranks, micro_batches),
            ScheduleKind::OneFOneB => one_f_one_b(ranks, micro_batches),
            ScheduleKind::Interleaved => interleaved_1f1b(ranks, micro_batches, virtual_stages),
            ScheduleKind::ZeroBubbleH1 => zero_bubble_h1(ranks, micro_batches),
        }
    }

    /// Stages in all: `ranks x virtual_stages`.
    pub fn stages(&self) -> usize {
        self.ranks * self.virtual_stages
    }

    /// The rank that runs `stage`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.ranks
    }

    /// Which of its rank's chunks `stage` is.
    pub fn chunk_of(&self, stage: usize) -> usize {
        stage / self.ranks
    }

    /// The bubble fraction the papers give for this schedule, with a forward costing `forward`
    /// and the two halves of backward `backward_input` and `backward_weight` (sends free):
    /// `(p-1)/(m+p-1)` for GPipe and 1F1B, `(p-1)/(v m+p-1)` interleaved, and for ZB-H1
    /// `(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))`, a third of 1F1B's bubble when they are equal.
    pub fn bubble_formula(&self, costs: &crate::Costs) -> f64 {
        let (p, m, v) = (
            self.ranks as f64,
            self.micro_batches as f64,
            self.virtual_stages as f64,
        );
        match self.kind {
            ScheduleKind::Gpipe | ScheduleKind::OneFOneB => (p - 1.0) / (m + p - 1.0),
            ScheduleKind::Interleaved => (p - 1.0) / (v * m + p - 1.0),
            ScheduleKind::ZeroBubbleH1 => {
                let (f, i, w) = (costs.forward, costs.backward_input, costs.backward_weight);
                let idle = (p - 1.0) * (f + i - w).max(0.0);
                idle / (m * (f + i + w) + idle)
            }
        }
    }

    /// The compute actions of `rank` as a line of letters, `F3` for the forward of micro-batch
    /// 3 (`F3.1` on chunk 1 when there are several chunks).
    pub fn describe(&self, rank: usize) -> String {
        self.actions[rank]
            .iter()
            .filter(|a| a.kind.is_compute())
            .map(|a| {
                let chunk = if self.virtual_stages > 1 {
                    format!(".{}", self.chunk_of(a.stage))
                } else {
                    String::new()
                };
                format!("{}{}{chunk}", a.kind.letter(), a.micro_batch)
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Checks that every micro-batch goes forward and backward exactly once through every
    /// stage, on the stage's rank, that every send has its receive, and that replaying the
    /// schedule with buffered sends finishes: no rank waits forever. The error names the first
    /// violation.
    pub fn validate(&self) -> Result<(), PipelineError> {
        let invalid = |message: String| Err(PipelineError::Schedule(message));
        if self.actions.len() != self.ranks {
            return invalid(format!(
                "{} action lists for {} ranks",
                self.actions.len(),
                self.ranks
            ));
        }
        // Every micro-batch runs forward at every stage: fewer actions than that cannot be a
        // schedule, and checking it first bounds the tables below by the actions there are.
        let actions: usize = self.actions.iter().map(Vec::len).sum();
        let forwards = (self.ranks.checked_mul(self.virtual_stages))
            .and_then(|stages| stages.checked_mul(self.micro_batches));
        if forwards.is_none_or(|forwards| forwards > actions) {
            return invalid(format!(
                "{actions} actions cannot run the forward of {} micro-batch(es) at each of {} x {} stages",
                self.micro_batches, self.ranks, self.virtual_stages
            ));
        }
        let mut counts = ActionTable::new(self, 0usize);
        for (rank, actions) in self.actions.iter().enumerate() {
            for action in actions {
                if action.stage >= self.stages() || action.micro_batch >= self.micro_batches {
                    return invalid(format!(
                        "rank {rank} runs the {action}, outside {} stages and {} micro-batches",
                        self.stages(),
                        self.micro_batches
                    ));
                }
                if self.rank_of(action.stage) != rank {
                    return invalid(format!(
                        "rank {rank} runs the {action}, but that stage lives on rank {}",
                        self.rank_of(action.stage)
                    ));
                }
                *counts.get_mut(action.kind, action.micro_batch, action.stage) += 1;
            }
        }
        let count = |kind, mb, stage| *counts.get(kind, mb, stage);
        for stage in 0..self.stages() {
            let rank = self.rank_of(stage);
            let crosses_before = stage > 0 && self.rank_of(stage - 1) != rank;
            let crosses_after = stage + 1 < self.stages() && self.rank_of(stage + 1) != rank;
            for mb in 0..self.micro_batches {
                // Formatted only for an error: validation runs for every simulation.
                let at = || format!("micro-batch {mb} at stage {stage} (rank {rank})");
                let forwards = count(Kind::Forward, mb, stage);
                if forwards != 1 {
                    return invalid(format!("{} runs forward {forwards} times, not once", at()));
                }
                let (full, input, weight) = (
                    count(Kind::Backward, mb, stage),
                    count(Kind::BackwardInput, mb, stage),
                    count(Kind::BackwardWeight, mb, stage),
                );
                if !((full, input, weight) == (1, 0, 0) || (full, input, weight) == (0, 1, 1)) {
                    return invalid(format!(
                        "{} runs {full} backward(s), {input} input half(s) and {weight} weight half(s); it needs one backward, or one of each half",
                        at()
                    ));
                }
                let expected = [
                    (Kind::RecvForward, crosses_before),
                    (Kind::SendBackward, crosses_before),
                    (Kind::SendForward, crosses_after),
                    (Kind::RecvBackward, crosses_after),
                ];
                for (kind, needed) in expected {
                    let n = count(kind, mb, stage);
                    if n != needed as usize {
                        return invalid(format!(
                            "{} has {n} {}, where it needs {}",
                            at(),
                            Action::new(kind, mb, stage),
                            needed as usize
                        ));
                    }
                }
            }
        }
        crate::simulate::replay(self, &crate::Costs::UNIT).map(|_| ())
    }
}

/// A value for every action a schedule can name, (kind, micro-batch, stage), in one dense
/// table: validation and simulation look one up per action.
pub(crate) struct ActionTable<T> {
    micro_batches: usize,
    stages: usize,
    values: Vec<T>,
}

impl<T: Clone> ActionTable<T> {
    /// `fill` for every action of `schedule`.
    pub(crate) fn new(schedule: &Schedule, fill: T) -> Self {
        let (micro_batches, stages) = (schedule.micro_batches, schedule.stages());
        Self {
            micro_batches,
            stages,
            values: vec![fill; Kind::COUNT * micro_batches * stages],
        }
    }

    fn index(&self, kind: Kind, micro_batch: usize, stage: usize) -> usize {
        debug_assert!(micro_batch < self.micro_batches && stage < self.stages);
        (kind as usize * self.micro_batches + micro_batch) * self.stages + stage
    }

    pub(crate) fn get(&self, kind: Kind, micro_batch: usize, stage: usize) -> &T {
        &self.values[self.index(kind, micro_batch, stage)]
    }

    pub(crate) fn get_mut(&mut self, kind: Kind, micro_batch: usize, stage: usize) -> &mut T {
        let i = self.index(kind, micro_batch, stage);
        &mut self.values[i]
    }
}

/// Adds the sends and receives to each rank's compute order: a receive just before the action
/// that needs it, a send just after the action that produced it. Neighbouring stages on one
/// rank (one rank only) hand over in memory.
fn with_communication(
    kind: ScheduleKind,
    ranks: usize,
    virtual_stages: usize,
    micro_batches: usize,
    compute: Vec<Vec<Action>>,
) -> Schedule {
    let stages = ranks * virtual_stages;
    let rank_of = |stage: usize| stage % ranks;
    let actions = compute
        .into_iter()
        .enumerate()
        .map(|(rank, order)| {
            let mut actions = Vec::with_capacity(order.len() * 2);
            for action in order {
                let (mb, s) = (action.micro_batch, action.stage);
                let from_previous = s > 0 && rank_of(s - 1) != rank;
                let to_next = s + 1 < stages && rank_of(s + 1) != rank;
                match action.kind {
                    Kind::Forward => {
                        if from_previous {
                            actions.push(Action::new(Kind::RecvForward, mb, s));
                        }
                        actions.push(action);
                        if to_next {
                            actions.push(Action::new(Kind::SendForward, mb, s));
                        }
                    }
                    Kind::Backward | Kind::BackwardInput => {
                        if to_next {
                            actions.push(Action::new(Kind::RecvBackward, mb, s));
                        }
                        actions.push(action);
                        if from_previous {
                            actions.push(Action::new(Kind::SendBackward, mb, s));
                        }
                    }
                    _ => actions.push(action),
                }
            }
            actions
        })
        .collect();
    Schedule {
        kind,
        ranks,
        virtual_stages,
        micro_batches,
        actions,
    }
}

fn check_sizes(ranks: usize, micro_batches: usize) -> Result<(), PipelineError> {
    if ranks == 0 || micro_batches == 0 {
        return Err(PipelineError::Config(
            "a pipeline needs at least one stage and one micro-batch".into(),
        ));
    }
    Ok(())
}

/// GPipe: each rank runs every forward, then every backward, in micro-batch order.
pub fn gpipe(ranks: usize, micro_batches: usize) -> Result<Schedule, PipelineError> {
    check_sizes(ranks, micro_batches)?;
    let compute = (0..ranks)
        .map(|rank| {
            let forwards = (0..micro_batches).map(|mb| Action::new(Kind::Forward, mb, rank));
            let backwards = (0..micro_batches).map(|mb| Action::new(Kind::Backward, mb, rank));
            forwards.chain(backwards).collect()
        })
        .collect();
    Ok(with_communication(
        ScheduleKind::Gpipe,
        ranks,
        1,
        micro_batches,
        compute,
    ))
}

/// 1F1B: rank `r` warms up with `ranks - r - 1` forwards, then alternates one forward and one
/// backward, then drains the remaining backwards.
pub fn one_f_one_b(ranks: usize, micro_batches: usize) -> Result<Schedule, PipelineError> {
    check_sizes(ranks, micro_batches)?;
    let compute = (0..ranks)
        .map(|rank| {
            let warmup = (ranks - rank - 1).min(micro_batches);
            let mut order: Vec<Action> = (0..warmup)
                .map(|mb| Action::new(Kind::Forward, mb, rank))
                .collect();
            for mb in 0..micro_batches - warmup {
                order.push(Action::new(Kind::Forward, warmup + mb, rank));
                order.push(Action::new(Kind::Backward, mb, rank));
            }
            order.extend(
                (micro_batches - warmup..micro_batches)
                    .map(|mb| Action::new(Kind::Backward, mb, rank)),
            );
            order
        })
        .collect();
    Ok(with_communication(
        ScheduleKind::OneFOneB,
        ranks,
        1,
        micro_batches,
        compute,
    ))
}

/// Interleaved 1F1B: each rank holds `virtual_stages` chunks (stage `c x ranks + r` is chunk
/// `c` of rank `r`). Micro-batches run in groups of `ranks`: a rank does a group's forwards on
/// chunk 0, then on chunk 1, and so on; backwards go through the chunks in reverse. The
/// warm-up is Megatron-LM's: `2 (ranks - r - 1) + (virtual_stages - 1) ranks` forwards.
pub fn interleaved_1f1b(
    ranks: usize,
    micro_batches: usize,
    virtual_stages: usize,
) -> Result<Schedule, PipelineError> {
    check_sizes(ranks, micro_batches)?;
    if virtual_stages < 2 {
        return Err(PipelineError::Config(format!(
            "interleaved 1F1B needs --virtual-stages 2 or more (got {virtual_stages}); use --schedule 1f1b for one chunk per rank"
        )));
    }
    if !micro_batches.is_multiple_of(ranks) {
        return Err(PipelineError::Config(format!(
            "interleaved 1F1B runs micro-batches in groups of --pp {ranks}, but --micro-batches is {micro_batches}; use a multiple of {ranks}"
        )));
    }
    let (p, v) = (ranks, virtual_stages);
    let total = micro_batches * v;
    // The k-th forward (or backward) of a rank: its micro-batch and chunk.
    let micro_batch = |k: usize| (k / (p * v)) * p + k % p;
    let forward_chunk = |k: usize| (k / p) % v;
    let backward_chunk = |k: usize| v - 1 - (k / p) % v;
    let compute = (0..ranks)
        .map(|rank| {
            let forward =
                |k| Action::new(Kind::Forward, micro_batch(k), forward_chunk(k) * p + rank);
            let backward =
                |k| Action::new(Kind::Backward, micro_batch(k), backward_chunk(k) * p + rank);
            let warmup = (2 * (p - rank - 1) + (v - 1) * p).min(total);
            let mut order: Vec<Action> = (0..warmup).map(forward).collect();
            for k in 0..total - warmup {
                order.push(forward(warmup + k));
                order.push(backward(k));
            }
            order.extend((total - warmup..total).map(backward));
            order
        })
        .collect();
    Ok(with_communication(
        ScheduleKind::Interleaved,
        ranks,
        virtual_stages,
        micro_batches,
        compute,
    ))
}

/// ZB-H1: 1F1B with backward split into an input half (I), on the critical path, and a weight
/// half (W). Rank `r` warms up with `ranks - r - 1` forwards, then runs `r` rounds of forward
/// and input half, deferring their weight halves, then rounds of forward, input half and weight
/// half, then the remaining input and weight halves, and last the `r` deferred weight halves,
/// which fill what was 1F1B's cool-down bubble. The first stage sends nothing back, so it runs
/// whole backwards.
pub fn zero_bubble_h1(ranks: usize, micro_batches: usize) -> Result<Schedule, PipelineError> {
    check_sizes(ranks, micro_batches)?;
    let compute = (0..ranks)
        .map(|rank| {
            let m = micro_batches;
            let f = |mb| Action::new(Kind::Forward, mb, rank);
            let mut order = Vec::with_capacity(3 * m);
            let mut weights = std::collections::VecDeque::new();
            let mut backward = |order: &mut Vec<Action>, mb: usize, defer: bool| {
                if rank == 0 {
                    order.push(Action::new(Kind::Backward, mb, rank));
                    return;
                }
                order.push(Action::new(Kind::BackwardInput, mb, rank));
                weights.push_back(mb);
                if !defer {
                    let oldest = weights.pop_front().expect("just pushed");
                    order.push(Action::new(Kind::BackwardWeight, oldest, rank));
                }
            };
            let warmup = (ranks - rank - 1).min(m);
            order.extend((0..warmup).map(f));
            let (mut forwards, mut backwards) = (warmup, 0);
            while forwards < m {
                order.push(f(forwards));
                forwards += 1;
                backward(&mut order, backwards, backwards < rank);
                backwards += 1;
            }
            while backwards < m {
                backward(&mut order, backwards, false);
                backwards += 1;
            }
            order.extend(
                weights
                    .drain(..)
                    .map(|mb| Action::new(Kind::BackwardWeight, mb, rank)),
            );
            order
        })
        .collect();
    Ok(with_communication(
        ScheduleKind::ZeroBubbleH1,
        ranks,
        1,
        micro_batches,
        compute,
    ))
}
