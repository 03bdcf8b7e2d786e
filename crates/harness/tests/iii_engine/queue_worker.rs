//! The double's model of the separately installed queue worker.

#[derive(Default)]
pub struct QueueWorker {}
