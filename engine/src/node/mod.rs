//! What runs on one node: what its actors share ([`shared`]), a
//! submission checked against the registry ([`intake`]), one actor per job attempt
//! ([`actor`]), one supervisor per node ([`supervisor`]), the job that
//! intake leased in its own commit, adopted by the supervisor
//! ([`handoff`]), and [`runtime`], which wires them together
//! ([`runtime::Engine`]).

pub mod actor;
pub mod handoff;
pub mod intake;
pub mod runtime;
pub mod shared;
pub mod supervisor;
