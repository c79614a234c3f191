//! The gradients of one backward, reduced unit by unit over the data-parallel group: averaged
//! whole (ZeRO-1) or reduce-scattered so each rank keeps only its part (ZeRO-2, ZeRO-3). A unit
//! starts as soon as its last gradient is in and every earlier unit has started, so every rank
//! issues the same collectives in the same order while backward goes on.

use std::sync::Arc;

use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use burn_comm::{Communicator, ReduceOp, Work};
use burn_ddp::MissingGradient;
use burn_ddp::params::{self, ParamSlot};

use crate::ZeroError;
use crate::flat::FlatLayout;
use crate::precision::cast;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;
/// One reduced gradient per unit: the whole buffer or this rank's part.
pub(crate) type UnitGrads<B> = Vec<Tensor<Inner<B>, 1>>;

/// What each rank keeps of a unit's averaged gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduction {
    /// The whole buffer (all-reduce).
    Whole,
    /// Its own part (reduce-scatter).
    Part,
}

impl Reduction {
    /// Starts the reduction of `flat`, in `dtype` when given.
    pub(crate) fn start<B: burn::tensor::backend::Backend>(
        self,
        comm: &Communicator,
        flat: Tensor<B, 1>,
        dtype: Option<DType>,
    ) -> Work<Tensor<B, 1>> {
        let flat = match dtype {
            Some(dtype) => cast(flat, dtype),
            None => flat,
        };
        match self {
            Reduction::Whole => comm.all_reduce_async(flat, ReduceOp::Avg),
            Reduction::Part => comm.reduce_scatter_async(flat, ReduceOp::Avg, 0),
        }
    }
}

/// One backward's reduction in progress.
pub(crate) struct Reducer<B: AutodiffBackend> {
    slots: Vec<ParamSlot<B>>,
    layout: Arc<FlatLayout>,
    reduction: Reduction,
    reduce_dtype: Option<DType>,
    comm: Communicator,
    unit_of: Vec<usize>,
    grads: Vec<Option<Tensor<Inner<B>, 1>>>,
    taken: Vec<bool>,
    has_grad: Vec<bool>,
    late: Vec<Option<Tensor<Inner<B>, 1>>>,
    /// Parameters known to get late parts: taken only after backward.
    known_late: Vec<bool>,
    waiting: Vec<usize>,
    next_unit: usize,
    in_flight: Vec<Work<Tensor<Inner<B>, 1>>>,
    /// Units started while backward was still running.
    pub overlapped: usize,
}

impl<B: AutodiffBackend> Reducer<B> {
    /// `slots` are the parameters `layout` indexes, their gradients reduced in `reduce_dtype`
    /// when given; those marked in `known_late` got parts after being taken in an earlier
    /// backward, so they wait for the end of this one.
    pub fn new(
        slots: Vec<ParamSlot<B>>,
        layout: Arc<FlatLayout>,
        reduction: Reduction,
        reduce_dtype: Option<DType>,
        comm: Communicator,
        known_late: Vec<bool>,
    ) -> Self {
        let n = slots.len();
        let mut unit_of = vec![0; n];
        for (u, unit) in layout.units.iter().enumerate() {
            for &p in &unit.params {
                unit_of[p] = u;
            }
        }
        let waiting = layout.units.iter().map(|u| u.params.len()).collect();
        Self {
            slots,
            layout,
            reduction,
            reduce_dtype,
            comm,
            unit_of,
            grads: vec![None; n],
            taken: vec![false; n],
            has_grad: vec![false; n],
            late: vec![None; n],
            known_late,
            waiting,
            next_unit: 0,
            in_flight: Vec::new(),
            overlapped: 0,
        }
    }

    /// During backward: takes the gradients that are in and starts the units they complete.
    pub fn take_ready(&mut self, grads: &mut B::Gradients) {
        let started = self.next_unit;
        for i in 0..self.slots.len() {
            if !self.taken[i]
                && !self.known_late[i]
                && let Some(grad) = (self.slots[i].take)(grads)
            {
                self.ready(i, Some(grad));
            }
        }
        self.overlapped += self.next_unit - started;
    }

    /// After backward: takes the rest (zeros where there is none, so every rank reduces the
    /// same units) and keeps any part that arrived after its parameter was taken.
    pub fn take_remaining(&mut self, grads: &mut B::Gradients) {
        self.take_each(|slot| (slot.take)(grads));
    }

    /// Takes every gradient from `grads`, computed outside the engine (a pipeline's).
    pub fn take_params(&mut self, grads: &mut GradientsParams) {
        self.take_each(|slot| (slot.take_param)(grads));
    }

    fn take_each(&mut self, mut take: impl FnMut(&ParamSlot<B>) -> Option<Tensor<Inner<B>, 1>>) {
        for i in 0..self.slots.len() {
            let grad = take(&self.slots[i]);
            if self.taken[i] {
                self.late[i] = grad;
            } else {
                self.ready(i, grad);
            }
        }
    }

    fn ready(&mut self, i: usize, grad: Option<Tensor<Inner<B>, 1>>) {
        self.taken[i] = true;
        self.has_grad[i] = grad.is_some();
        self.grads[i] = grad;
        let unit = self.unit_of[i];
        self.waiting[unit] -= 1;
        while self.next_unit < self.waiting.len() && self.waiting[self.next_unit] == 0 {
            let parts = self.parts(self.next_unit, |me, p| me.grads[p].take());
            let flat = self.layout.flatten(self.next_unit, parts);
            self.in_flight
                .push(self.reduction.start(&self.comm, flat, self.reduce_dtype));
            self.next_unit += 1;
        }
    }

    /// `unit`'s parameters' tensors from `get`, zeros where it has none.
    fn parts(
        &mut self,
        unit: usize,
        get: impl Fn(&mut Self, usize) -> Option<Tensor<Inner<B>, 1>>,
    ) -> Vec<Tensor<Inner<B>, 1>> {
        self.layout.units[unit]
            .params
            .clone()
            .into_iter()
            .map(|p| {
                get(self, p).unwrap_or_else(|| {
                    let slot = &self.slots[p];
                    Tensor::zeros([slot.numel], (&slot.device, slot.dtype))
                })
            })
            .collect()
    }

    /// Waits for every unit, adds the late parts (reduced over the union of every rank's late
    /// units), and checks that every parameter had a gradient on every rank. Returns each
    /// unit's reduced gradient (the whole buffer or this rank's part) and which parameters got
    /// late parts on some rank.
    pub fn finish(mut self) -> Result<(UnitGrads<B>, Vec<bool>), ZeroError> {
        assert_eq!(
            self.next_unit,
            self.layout.units.len(),
            "every unit started"
        );
        let mut reduced = Vec::with_capacity(self.in_flight.len());
        for work in std::mem::take(&mut self.in_flight) {
            reduced.push(work.wait()?);
        }
        // One exchange of per-parameter codes: bit 0 "had a gradient", bit 1 "got a late part".
        let codes: Vec<i32> = (0..self.slots.len())
            .map(|i| self.has_grad[i] as i32 | (self.late[i].is_some() as i32) << 1)
            .collect();
        let codes = params::gather_codes::<Inner<B>>(&self.comm, &codes, &self.slots[0].device)?;
        let missing: Vec<MissingGradient> = codes
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let ranks: Vec<usize> = (0..c.len()).filter(|&r| c[r] & 1 == 0).collect();
                (!ranks.is_empty()).then(|| MissingGradient {
                    name: self.slots[i].name.clone(),
                    ranks,
                })
            })
            .collect();
        if !missing.is_empty() {
            return Err(ZeroError::MissingGradients(missing));
        }
        let late: Vec<bool> = codes
            .iter()
            .map(|c| c.iter().any(|&c| c & 2 != 0))
            .collect();
        let late_units: Vec<usize> = (0..self.layout.units.len())
            .filter(|&u| self.layout.units[u].params.iter().any(|&p| late[p]))
            .collect();
        for unit in late_units {
            let parts = self.parts(unit, |me, p| me.late[p].take());
            let flat = self.layout.flatten(unit, parts);
            let extra = self
                .reduction
                .start(&self.comm, flat, self.reduce_dtype)
                .wait()?;
            reduced[unit] = reduced[unit].clone() + extra;
        }
        Ok((reduced, late))
    }
}
