//! The rules: pure decisions, no I/O and no SQL. The states and their
//! transitions ([`lifecycle`]), idempotency keys ([`keys`]), what a failed
//! outgoing request was ([`failure`]) and what a failure means
//! ([`verdict`]), backoff ([`retry`]), provider limits and their arithmetic
//! ([`quota`]), how a wait ends ([`wait_machine`]), a signal's rules
//! ([`signal`]), a cron's fire times ([`schedule`]), and what a stored JSON
//! value may hold ([`payload`]), the events a consumer is sent
//! ([`event`]), and W3C trace context ([`traceparent`]). Each is tested without a database.

pub mod event;
pub mod failure;
pub mod keys;
pub mod lifecycle;
pub mod payload;
pub mod quota;
pub mod retry;
pub mod schedule;
pub mod signal;
pub mod traceparent;
pub mod verdict;
pub mod wait_machine;
