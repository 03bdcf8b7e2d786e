//! The step's first write, held back while the model answers.
//!
//! A step writes twice on its own path: before the model is called (the `working` status, the
//! first step's `turn_started` event, the empty assistant entry) and after it answered (the
//! answer, the record, and on a last step the terminal writes). Each commit is a round trip
//! through the single store writer, and the first one carries nothing a reader needs while the
//! model answers at once. So the step keeps the first write, and the session lock with it,
//! until one of:
//!
//! - `first_write_hold_ms` passed with the model still answering (20 ms unless configured:
//!   well under what a person notices, well over what an in-process model takes): committed,
//!   so a person watching sees the session working, and a slow model costs what it did;
//! - the stream is about to write a partial answer into the entry: committed first, since the
//!   entry must exist;
//! - the generation ended: the step puts the write at the head of its last batch (one commit
//!   for the step), or commits it when something else must look first (a post-generate hook,
//!   a failed generation, a retry after an overflow).
//!
//! The lock is what makes holding safe: no other writer of the session (a stop's finalize, a
//! steering delivery, a resolve) can land between the two writes and be overwritten by the
//! `working` status or find the assistant entry missing. A stop is not delayed by it: its abort
//! reaches the stream without the lock, and the stream ends at once.
//!
//! A crash while the write is held loses only it: the step is redelivered, finds no assistant
//! entry and calls the model again, as it does when a crash cuts the stream. The crash
//! failpoint `after_assistant_appended` travels with the write and is reached by the commit
//! that makes the entry durable, wherever that is.

use std::time::Duration;

use tokio::time::Instant;

use crate::harness::{Harness, Result, StepWrites};
use crate::locks::SessionGuard;

/// The held write and the session lock, or nothing once committed.
pub(crate) struct FirstWrite {
    held: Option<(StepWrites, SessionGuard)>,
    until: Instant,
}

impl FirstWrite {
    /// `batch`, held under `guard` for at most `hold`.
    pub(crate) fn hold(batch: StepWrites, guard: SessionGuard, hold: Duration) -> FirstWrite {
        FirstWrite {
            held: Some((batch, guard)),
            until: Instant::now() + hold,
        }
    }

    pub(crate) fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// When the write is due on its own.
    pub(crate) fn until(&self) -> Instant {
        self.until
    }

    /// The held write and lock, for the step's last batch.
    pub(crate) fn take(&mut self) -> Option<(StepWrites, SessionGuard)> {
        self.held.take()
    }
}

impl Harness {
    /// Commits the held write, if any, and releases the session lock held with it.
    pub(crate) async fn release_first(&self, first: &mut FirstWrite) -> Result<()> {
        if let Some((batch, guard)) = first.held.take() {
            self.commit(batch).await?;
            drop(guard);
        }
        Ok(())
    }
}
