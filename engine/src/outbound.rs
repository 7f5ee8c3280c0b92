//! Outgoing HTTP (model provider, webhooks, tools) and the classification of
//! its failures. Retryability is decided here, exhaustively, once.

use std::time::Duration;

use crate::error::ErrorEnvelope;
use crate::faults::{FailPoint, Faults, Injected};
use crate::retry::parse_retry_after;

/// How an outgoing request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The connection was never established: the request did not leave. Safe to retry.
    NotSent(String),
    /// Sent, but the outcome is unknown (timeout, reset). Retried with the same key.
    Ambiguous(String),
    /// The server answered with a non-2xx status.
    Status {
        status: u16,
        retry_after: Option<Duration>,
        body: String,
    },
    /// A 2xx whose body we could not read or understand.
    BadResponse(String),
}

impl Failure {
    /// Network errors, timeouts, 408, 429 and 5xx are retried; other 4xx are permanent.
    pub fn is_retryable(&self) -> bool {
        match self {
            Failure::NotSent(_) | Failure::Ambiguous(_) | Failure::BadResponse(_) => true,
            Failure::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
        }
    }

    /// The request certainly did not reach the server.
    pub fn never_sent(&self) -> bool {
        match self {
            Failure::NotSent(_) => true,
            Failure::Ambiguous(_) | Failure::Status { .. } | Failure::BadResponse(_) => false,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            Failure::Status { status, .. } => Some(*status),
            Failure::NotSent(_) | Failure::Ambiguous(_) | Failure::BadResponse(_) => None,
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Failure::Status { retry_after, .. } => *retry_after,
            Failure::NotSent(_) | Failure::Ambiguous(_) | Failure::BadResponse(_) => None,
        }
    }

    pub fn envelope(&self) -> ErrorEnvelope {
        let (code, message) = match self {
            Failure::NotSent(m) => ("not_sent".to_owned(), m.clone()),
            Failure::Ambiguous(m) => ("ambiguous".to_owned(), m.clone()),
            Failure::Status { status, body, .. } => (
                format!("http_{status}"),
                format!(
                    "HTTP {status}: {}",
                    body.chars().take(500).collect::<String>()
                ),
            ),
            Failure::BadResponse(m) => ("bad_response".to_owned(), m.clone()),
        };
        ErrorEnvelope {
            code,
            message,
            retryable: self.is_retryable(),
        }
    }
}

/// An outgoing request did not produce a 2xx.
#[derive(Debug)]
pub enum PostError {
    Failed(Failure),
    Injected(Injected),
}

/// One outgoing JSON POST.
#[derive(Debug)]
pub struct Post<'a> {
    pub url: &'a str,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
    /// Whether a 2xx answer's body matters. When it does not (a webhook:
    /// the status alone decides), a 2xx is success even if its body cannot
    /// be read, and the body is not read at all.
    pub need_body: bool,
}

/// The failpoint hit once the server has answered and before the answer is read.
#[derive(Debug, Clone, Copy)]
pub struct Seam<'a> {
    pub faults: &'a Faults,
    pub job_id: &'a str,
    pub point: FailPoint,
}

/// Sends `post`; returns the 2xx status and body. `seam`, when given, is
/// hit once the server has answered and before the answer is read.
pub async fn post(
    client: &reqwest::Client,
    post: Post<'_>,
    seam: Option<Seam<'_>>,
) -> Result<(u16, Vec<u8>), PostError> {
    let Post {
        url,
        headers,
        body,
        timeout,
        need_body,
    } = post;
    let mut request = client
        .post(url)
        .timeout(timeout)
        .header("content-type", "application/json")
        .body(body);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let response = request
        .send()
        .await
        .map_err(|e| PostError::Failed(classify(&e)))?;
    if let Some(seam) = seam {
        seam.faults
            .hit(seam.job_id, seam.point)
            .await
            .map_err(PostError::Injected)?;
    }
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after);
    if (200..300).contains(&status) && !need_body {
        return Ok((status, Vec::new()));
    }
    let bytes = response
        .bytes()
        .await
        .map_err(|e| PostError::Failed(Failure::Ambiguous(format!("reading the response: {e}"))))?;
    if (200..300).contains(&status) {
        Ok((status, bytes.to_vec()))
    } else {
        Err(PostError::Failed(Failure::Status {
            status,
            retry_after,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }))
    }
}

fn classify(e: &reqwest::Error) -> Failure {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    if e.is_connect() {
        Failure::NotSent(message)
    } else {
        Failure::Ambiguous(message)
    }
}
