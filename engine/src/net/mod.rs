//! The network edge: one classified HTTP POST ([`outbound`]), the model
//! call ([`provider`]), the completion webhook ([`webhook`]), the SSRF
//! guard every caller- or model-chosen URL passes ([`guard`]). Every
//! request carries the job's W3C trace context
//! ([`crate::rules::traceparent`]). What a failure *means* is decided below,
//! in [`crate::rules`].

pub mod guard;
pub mod outbound;
pub mod provider;
pub mod webhook;
