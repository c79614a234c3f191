//! The local copy of the model a data-parallel wrapper holds. burn modules are values that an
//! optimizer consumes and returns, so the wrapper owns the module and replaces it in place.

pub(crate) struct Replica<M>(Option<M>);

impl<M> Replica<M> {
    pub fn new(module: M) -> Self {
        Self(Some(module))
    }

    pub fn get(&self) -> &M {
        self.0
            .as_ref()
            .expect("the module is back after every update")
    }

    pub fn into_inner(self) -> M {
        self.0.expect("the module is back after every update")
    }

    /// Replaces the module by `update(module)`.
    pub fn update(&mut self, update: impl FnOnce(M) -> M) {
        let module = self
            .0
            .take()
            .expect("the module is back after every update");
        self.0 = Some(update(module));
    }
}
