//! The command line: `onceflow serve`, `migrate`, `token`, and the API's
//! commands (`submit`, `status`, `watch`, `jobs`, `signal`, `schedule`, …).
//! [`app::App`] parses it and runs a node with the caller's workflows; the
//! typed HTTP client the commands use is [`crate::Client`], beside this.

pub mod app;
pub(crate) mod client;
pub mod config;
pub(crate) mod serve;
pub(crate) mod token;
