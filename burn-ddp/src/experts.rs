//! Parameters that only some ranks of a data-parallel group hold: a mixture of experts' expert
//! weights under expert parallelism (Megatron's "expert data parallel" group). Every rank of
//! the group reads its own samples, but a rank's experts also compute on the tokens the
//! other ranks of its expert-parallel group sent them, so their gradient already sums those
//! ranks' contributions. Averaging it over the whole group would mix different experts;
//! it is summed over the ranks holding the same experts instead and divided by the whole
//! group's size, as Megatron scales expert gradients.

use std::collections::HashSet;

use burn::module::ParamId;
use burn_comm::Communicator;

use crate::DdpError;

/// The parameters held by only some ranks of a data-parallel group, and the ranks holding
/// the same ones as this rank.
#[derive(Debug, Clone)]
pub struct ExpertGroup {
    /// The ranks of the data-parallel group holding this rank's experts (a subgroup of it,
    /// whose size divides it).
    pub comm: Communicator,
    /// The experts' parameters.
    pub params: HashSet<ParamId>,
}

impl ExpertGroup {
    /// Refuses a group that cannot be a part of `data_parallel`.
    pub(crate) fn check(&self, data_parallel: &Communicator) -> Result<(), DdpError> {
        let (part, whole) = (self.comm.size(), data_parallel.size());
        if !whole.is_multiple_of(part) {
            return Err(DdpError::Config(format!(
                "the {part} ranks holding the same experts are not a part of the {whole} data-parallel ranks (their count must divide it)"
            )));
        }
        Ok(())
    }

    /// What the experts' averaged gradient is multiplied by: the share of the data-parallel
    /// group this group is (the gradients came from all of it).
    pub(crate) fn scale(&self, data_parallel: &Communicator) -> f64 {
        self.comm.size() as f64 / data_parallel.size() as f64
    }
}
