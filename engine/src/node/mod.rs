//! What runs on one node: what its actors share ([`shared`]), a
//! submission checked against the registry ([`intake`]), one actor per job attempt
//! ([`actor`]), one supervisor per node ([`supervisor`]), and the job that
//! intake leased in its own commit, adopted by the supervisor
//! ([`handoff`]). [`crate::runtime`] wires them together.

pub mod actor;
pub mod handoff;
pub mod intake;
pub mod shared;
pub mod supervisor;
