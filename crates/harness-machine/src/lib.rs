//! The harness loop's decisions, without its I/O: the turn machine ([`machine`]), the call
//! machine ([`call`]), the typed turn record they act on ([`record`]) and the output contract's
//! pure checks ([`output`]), and every text the loop writes for a person or the model
//! ([`texts`]). [`coverage`] counts the table rows a run takes, when asked to.
//!
//! Nothing in this crate awaits or touches a bus, a store or a clock: its dependencies leave no
//! way to, so "pure" is checked by the compiler (the one file it may write is the coverage
//! list, and only when `HARNESS_MACHINE_COVERAGE` names a directory). `harness-core` gathers inputs, asks these
//! machines, and carries out the effects they return.

pub mod call;
pub mod coverage;
pub mod machine;
pub mod output;
pub mod record;
pub mod texts;
