//! What a failed outgoing request was: never sent, ambiguous, a status,
//! a bad answer, refused by the guard, too large. Whether each is retried
//! is decided here, exhaustively, once; [`crate::net::outbound`] classifies
//! a request's outcome into one, and [`crate::rules::verdict`] decides what
//! it means for the job.

use std::time::Duration;

use crate::error::ErrorEnvelope;

/// How an outgoing request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The connection was never established: the request did not leave. Safe to retry.
    NotSent(String),
    /// Sent, but the outcome is unknown (timeout, reset). Retried with the same key.
    Ambiguous(String),
    /// The server answered with a non-2xx status.
    Status {
        /// The HTTP status code.
        status: u16,
        /// The server's `Retry-After`, if it sent one.
        retry_after: Option<Duration>,
        /// The error body, when the request keeps it ([`crate::net::outbound::Read::BodyAndErrors`]); else empty.
        body: String,
    },
    /// A 2xx whose body we could not read or understand.
    BadResponse(String),
    /// The SSRF guard refused the destination: nothing was sent.
    Refused(String),
    /// The answer was larger than the cap for it; onceflow hung up.
    TooLarge {
        /// The cap, in bytes.
        limit: usize,
    },
}

impl Failure {
    /// Network errors, timeouts, 408, 429 and 5xx are retried; other 4xx are permanent.
    pub fn is_retryable(&self) -> bool {
        match self {
            Failure::NotSent(_) | Failure::Ambiguous(_) | Failure::BadResponse(_) => true,
            Failure::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
            Failure::Refused(_) | Failure::TooLarge { .. } => false,
        }
    }

    /// The request certainly did not reach the server.
    pub fn never_sent(&self) -> bool {
        match self {
            Failure::NotSent(_) | Failure::Refused(_) => true,
            Failure::Ambiguous(_)
            | Failure::Status { .. }
            | Failure::BadResponse(_)
            | Failure::TooLarge { .. } => false,
        }
    }

    /// The HTTP status, when the server answered with one.
    pub fn status(&self) -> Option<u16> {
        match self {
            Failure::Status { status, .. } => Some(*status),
            Failure::NotSent(_)
            | Failure::Ambiguous(_)
            | Failure::BadResponse(_)
            | Failure::Refused(_)
            | Failure::TooLarge { .. } => None,
        }
    }

    /// The server's `Retry-After`, when it answered with one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Failure::Status { retry_after, .. } => *retry_after,
            Failure::NotSent(_)
            | Failure::Ambiguous(_)
            | Failure::BadResponse(_)
            | Failure::Refused(_)
            | Failure::TooLarge { .. } => None,
        }
    }

    /// What is stored and shown: onceflow's own short reason and the
    /// status. The body of a non-2xx answer is kept only when the request
    /// kept it (the provider's, with credentials redacted), never a webhook
    /// consumer's or a tool target's.
    pub fn envelope(&self) -> ErrorEnvelope {
        let (code, message) = match self {
            Failure::NotSent(m) => ("not_sent".to_owned(), m.clone()),
            Failure::Ambiguous(m) => ("ambiguous".to_owned(), m.clone()),
            Failure::Status { status, body, .. } => (
                format!("http_{status}"),
                match (status, body.is_empty()) {
                    (300..=399, _) => {
                        format!("HTTP {status}: redirects are not followed")
                    }
                    (_, true) => format!("HTTP {status}"),
                    (_, false) => format!("HTTP {status}: {body}"),
                },
            ),
            Failure::BadResponse(m) => ("bad_response".to_owned(), m.clone()),
            Failure::Refused(m) => ("url_refused".to_owned(), m.clone()),
            Failure::TooLarge { limit } => (
                "response_too_large".to_owned(),
                format!("the answer exceeded {limit} bytes; onceflow stopped reading it"),
            ),
        };
        ErrorEnvelope {
            code,
            message,
            retryable: self.is_retryable(),
        }
    }
}
