use burn_comm::CommError;

/// What can go wrong in data parallelism. Every variant says what to change.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective failed (a peer failed, timed out or disagreed).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The global batch cannot be split evenly over the ranks.
    #[error(
        "the global batch of {global} samples does not divide by the {world} data-parallel ranks; use a multiple of {world}"
    )]
    BatchNotDivisible {
        /// Global batch size.
        global: usize,
        /// Data-parallel world size.
        world: usize,
    },
    /// Parameters that got no gradient on some ranks.
    #[error(
        "no gradient for {}: the loss did not use them there. Use every parameter on every rank, or set DdpConfig::allow_unused_parameters",
        MissingGradient::describe_all(.0)
    )]
    MissingGradients(Vec<MissingGradient>),
    /// A configuration that cannot work.
    #[error("{0}")]
    Config(String),
}

/// A parameter and the ranks on which it got no gradient.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingGradient {
    /// The parameter's path in the module, such as `layers.0.mlp.up_proj`.
    pub name: String,
    /// Ranks of the data-parallel group that had no gradient for it.
    pub ranks: Vec<usize>,
}

impl MissingGradient {
    /// "`name` on rank(s) [..], ..." for an error message.
    pub fn describe_all(missing: &[MissingGradient]) -> String {
        missing
            .iter()
            .map(|m| format!("`{}` on rank(s) {:?}", m.name, m.ranks))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
