//! Outgoing HTTP (model provider, webhooks, tools), each failure classified
//! as a [`Failure`] (whose retryability [`crate::rules::failure`] decides,
//! exhaustively, once).

use std::time::Duration;

use crate::faults::{FailPoint, Faults, Injected};
use crate::rules::failure::Failure;

/// An outgoing request did not produce a 2xx.
#[derive(Debug)]
pub enum PostError {
    /// The request failed, as classified.
    Failed(Failure),
    /// A failpoint fired at the request's seam.
    Injected(Injected),
}

/// One outgoing JSON POST.
#[derive(Debug)]
pub struct Post<'a> {
    /// Where it is sent.
    pub url: &'a str,
    /// Extra headers (`Idempotency-Key`, `traceparent`, signatures, …).
    pub headers: Vec<(&'static str, String)>,
    /// The JSON body, serialised.
    pub body: Vec<u8>,
    /// How long the whole request may take.
    pub timeout: Duration,
    /// What of the answer is read.
    pub read: Read,
    /// The SSRF guard for a caller- or model-chosen URL (`None`: the
    /// operator's own, e.g. the provider). Names are checked again when they
    /// resolve, by the client's [`GuardedResolver`](crate::net::guard::GuardedResolver).
    pub guard: Option<&'a crate::net::guard::UrlGuard>,
}

/// How much of an answer is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The status alone decides (a webhook): no body is read or kept.
    Status,
    /// A 2xx body is returned, read up to `limit` bytes (more is
    /// `response_too_large`); a non-2xx body is dropped.
    Body {
        /// The most bytes read.
        limit: usize,
    },
    /// As `Body`, and a non-2xx body is kept (its first 500 characters,
    /// credentials redacted) for the operator: the provider's.
    BodyAndErrors {
        /// The most bytes read of a 2xx body.
        limit: usize,
    },
}

/// The failpoint hit once the server has answered and before the answer is read.
#[derive(Debug, Clone, Copy)]
pub struct Seam<'a> {
    /// The engine's failpoint registry.
    pub faults: &'a Faults,
    /// The job making the request.
    pub job_id: &'a str,
    /// The failpoint to hit.
    pub point: FailPoint,
}

/// The POST of `body` to `url` with `headers`, once `guard` (when given)
/// let the URL through: literal addresses here, names when they resolve.
fn guarded(
    client: &reqwest::Client,
    url: &str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    guard: Option<&crate::net::guard::UrlGuard>,
) -> Result<reqwest::RequestBuilder, PostError> {
    if let Some(guard) = guard {
        let parsed = url::Url::parse(url)
            .map_err(|e| PostError::Failed(Failure::Refused(format!("not a valid URL: {e}"))))?;
        guard
            .check(&parsed)
            .map_err(|r| PostError::Failed(Failure::Refused(r.0)))?;
    }
    let mut request = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    Ok(request)
}

/// Hits `seam`'s failpoint, when there is one: the server has answered.
async fn hit(seam: Option<Seam<'_>>) -> Result<(), PostError> {
    if let Some(seam) = seam {
        seam.faults
            .hit(seam.job_id, seam.point)
            .await
            .map_err(PostError::Injected)?;
    }
    Ok(())
}

/// The server's `Retry-After`, when it sent one that parses.
fn retry_after_of(response: &reqwest::Response) -> Option<Duration> {
    response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after)
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
        read,
        guard,
    } = post;
    let request = guarded(client, url, headers, body, guard)?.timeout(timeout);
    // The URL stays out of the error (it may carry a key in its query).
    let response = request.send().await.map_err(|e| {
        let e = e.without_url();
        PostError::Failed(match guard {
            Some(_) => for_tenant(&e),
            None => classify(&e),
        })
    })?;
    hit(seam).await?;
    let status = response.status().as_u16();
    let retry_after = retry_after_of(&response);
    let success = (200..300).contains(&status);
    let (limit, keep_errors) = match read {
        // Dropped unread: the connection closes; the status decides.
        Read::Status => (None, false),
        Read::Body { limit } => (Some(limit), false),
        Read::BodyAndErrors { limit } => (Some(limit), true),
    };
    let bytes = match limit {
        Some(limit) if success || keep_errors => read_capped(response, limit).await?,
        _ => Vec::new(),
    };
    if success {
        Ok((status, bytes))
    } else {
        Err(PostError::Failed(Failure::Status {
            status,
            retry_after,
            body: redact(&String::from_utf8_lossy(&bytes)),
        }))
    }
}

/// Sends `post` and returns the open 2xx response for the caller to read
/// as it arrives (a stream of server-sent events); a non-2xx answer is read
/// (its first 64 KiB, credentials redacted) into the error, as
/// [`Read::BodyAndErrors`] does. `post.read` is not used, and
/// `post.timeout` bounds the wait for the answer's head only: a stream's
/// reader bounds each gap between chunks itself, as a whole-request
/// timeout would cut a long answer that is still flowing.
pub async fn open(
    client: &reqwest::Client,
    post: Post<'_>,
    seam: Option<Seam<'_>>,
) -> Result<(u16, reqwest::Response), PostError> {
    let Post {
        url,
        headers,
        body,
        timeout,
        guard,
        ..
    } = post;
    let request = guarded(client, url, headers, body, guard)?;
    let response = tokio::time::timeout(timeout, request.send())
        .await
        .map_err(|_| {
            PostError::Failed(Failure::Ambiguous(format!(
                "no answer within {} ms",
                timeout.as_millis()
            )))
        })?
        .map_err(|e| PostError::Failed(classify(&e.without_url())))?;
    hit(seam).await?;
    let status = response.status().as_u16();
    if (200..300).contains(&status) {
        return Ok((status, response));
    }
    let retry_after = retry_after_of(&response);
    let bytes = read_capped(response, 64 << 10).await.unwrap_or_default();
    Err(PostError::Failed(Failure::Status {
        status,
        retry_after,
        body: redact(&String::from_utf8_lossy(&bytes)),
    }))
}

/// Reads at most `limit` bytes of `response`; more is `response_too_large`
/// and the rest is never read (the connection is dropped).
async fn read_capped(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, PostError> {
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(PostError::Failed(Failure::TooLarge { limit }));
    }
    let mut bytes = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if bytes.len() + chunk.len() > limit {
                    return Err(PostError::Failed(Failure::TooLarge { limit }));
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(bytes),
            Err(e) => {
                return Err(PostError::Failed(Failure::Ambiguous(format!(
                    "reading the response: {e}"
                ))))
            }
        }
    }
}

/// The first 500 characters of an error body, with anything that looks like
/// a credential replaced by `[redacted]`: `sk-…` keys, `Bearer …` tokens,
/// and the values of keys named like `*key*`, `*token*`, `*secret*`,
/// `*password*` or `authorization`.
pub fn redact(body: &str) -> String {
    let short: String = body.chars().take(500).collect();
    let mut out = String::with_capacity(short.len());
    let mut rest = short.as_str();
    let sensitive = |name: &str| {
        let n = name.to_ascii_lowercase();
        ["key", "token", "secret", "password", "authorization"]
            .iter()
            .any(|w| n.contains(w))
    };
    while !rest.is_empty() {
        // A run of word characters (the token) and what follows it.
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_' || c == '.'))
            .unwrap_or(rest.len());
        let (word, after) = rest.split_at(end);
        if word.starts_with("sk-") && word.len() > 8 {
            out.push_str("[redacted]");
        } else if ["bearer", "basic", "token"]
            .iter()
            .any(|scheme| word.eq_ignore_ascii_case(scheme))
            && after.starts_with(char::is_whitespace)
        {
            // `Bearer <token>`, `Basic <credentials>`, `Token <token>`.
            out.push_str(word);
            out.push(' ');
            let value = after.trim_start();
            let end = value
                .find(|c: char| c.is_whitespace() || c == '"' || c == ',')
                .unwrap_or(value.len());
            out.push_str("[redacted]");
            rest = &value[end..];
            continue;
        } else if !word.is_empty() && sensitive(word) {
            // `"api_key": "…"` or `api_key=…`: keep the name, drop the value.
            out.push_str(word);
            let sep = after
                // A backslash too: `api_key=\"…\"` inside a JSON string.
                .find(|c: char| {
                    !(c == '"' || c == '\'' || c == ':' || c == '=' || c == ' ' || c == '\\')
                })
                .unwrap_or(after.len());
            if sep > 0 && after[..sep].contains([':', '=']) {
                out.push_str(&after[..sep]);
                // `Authorization: Bearer <token>`: the scheme stays, the token goes.
                let mut sep = sep;
                if let Some(scheme) = after
                    .get(sep..sep + 7)
                    .filter(|s| s.eq_ignore_ascii_case("bearer "))
                {
                    out.push_str(scheme);
                    sep += 7;
                }
                let value_end = after[sep..]
                    .find(|c: char| {
                        c == '"'
                            || c == '\''
                            || c == ','
                            || c == '}'
                            || c == '\\'
                            || c.is_whitespace()
                    })
                    .map_or(after.len(), |i| sep + i);
                out.push_str("[redacted]");
                rest = &after[value_end..];
                continue;
            }
            rest = after;
            continue;
        } else {
            out.push_str(word);
        }
        let mut chars = after.chars();
        match chars.next() {
            Some(c) => {
                out.push(c);
                rest = chars.as_str();
            }
            None => rest = "",
        }
    }
    out
}

/// A failed request to a caller- or model-chosen URL, as the caller may
/// see it: a fixed class (`dns_failed`, `connect_failed`, `timeout`,
/// `request_failed`), never the operating system's words ("Connection
/// refused", "Name or service not known"), which would make onceflow a
/// port and name scanner of its own network. The node's log keeps them.
fn for_tenant(e: &reqwest::Error) -> Failure {
    let detail = classify(e);
    let mut chain = String::new();
    let mut source: Option<&dyn std::error::Error> = Some(e);
    while let Some(s) = source {
        chain.push_str(&s.to_string().to_ascii_lowercase());
        chain.push(' ');
        source = s.source();
    }
    let refused_name = {
        let mut source: Option<&dyn std::error::Error> = Some(e);
        let mut found = false;
        while let Some(s) = source {
            found |= s.downcast_ref::<crate::net::guard::RefusedName>().is_some();
            source = s.source();
        }
        found
    };
    let class = if matches!(detail, Failure::Refused(_)) {
        return detail;
    } else if refused_name {
        // Told as a name that does not resolve, and retried as one.
        tracing::warn!(error = ?detail, "a host name resolves only to refused addresses");
        return Failure::NotSent("dns_failed: the host name did not resolve".to_owned());
    } else if e.is_timeout() {
        "timeout: no answer within the time allowed"
    } else if chain.contains("dns error") || chain.contains("failed to lookup") {
        "dns_failed: the host name did not resolve"
    } else if e.is_connect() {
        "connect_failed: the connection could not be made"
    } else {
        "request_failed: the request failed after it was sent"
    };
    tracing::warn!(error = ?detail, class, "an outgoing request failed");
    match detail {
        Failure::NotSent(_) => Failure::NotSent(class.to_owned()),
        _ => Failure::Ambiguous(class.to_owned()),
    }
}

fn classify(e: &reqwest::Error) -> Failure {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(refused) = s.downcast_ref::<crate::net::guard::Refused>() {
            return Failure::Refused(refused.0.clone());
        }
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

/// Parses a `Retry-After` header value: delta-seconds or an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let delta = at.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(delta.to_std().unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        assert_eq!(parse_retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn credentials_in_error_bodies_are_redacted() {
        let body = r#"{"error": {"message": "Incorrect API key provided: sk-proj-abcdef123456. Header Authorization: Bearer abc.def-ghi, or Basic dXNlcjpwdw== or token  tok123", "api_key": "hunter2", "code": "invalid"}}"#;
        let out = redact(body);
        assert!(!out.contains("sk-proj-abcdef123456"), "{out}");
        assert!(!out.contains("abc.def-ghi"), "{out}");
        assert!(!out.contains("hunter2"), "{out}");
        assert!(!out.contains("dXNlcjpwdw"), "{out}");
        assert!(!out.contains("tok123"), "{out}");
        assert!(out.contains("Incorrect API"), "{out}");
        assert!(out.contains("\"code\": \"invalid\""), "{out}");
        assert_eq!(redact(&"x".repeat(2000)).len(), 500);
        // Quoted inside a JSON string: `api_key=\"…\"`.
        for body in [
            r#"{"error": {"message": "rejected api_key=\"hunter2\" for this org"}}"#,
            r#"{"error": "api_key=hunter2"}"#,
            r#"api_key='hunter2'"#,
        ] {
            let out = redact(body);
            assert!(!out.contains("hunter2"), "{out}");
            assert!(out.contains("api_key"), "{out}");
        }
        // Never panics on multi-byte text around the names it looks for.
        for text in [
            "token: é",
            "key=ü",
            "Bearer ☃",
            "authorization:béarer x",
            "sk-ééééééééé",
        ] {
            let _ = redact(text);
        }
    }

    #[test]
    fn non_2xx_bodies_are_not_reflected_and_redirects_say_so() {
        let f = Failure::Status {
            status: 302,
            retry_after: None,
            body: String::new(),
        };
        assert!(!f.is_retryable());
        assert!(f.envelope().message.contains("redirects are not followed"));
        let f = Failure::Status {
            status: 500,
            retry_after: None,
            body: String::new(),
        };
        assert_eq!(f.envelope().message, "HTTP 500");
        let f = Failure::TooLarge { limit: 10 };
        assert_eq!(f.envelope().code, "response_too_large");
        assert!(!f.is_retryable() && !f.never_sent());
        let f = Failure::Refused("x".into());
        assert_eq!(f.envelope().code, "url_refused");
        assert!(!f.is_retryable() && f.never_sent());
    }

    /// A name that resolves only to refused addresses reads to the caller
    /// exactly as a name that does not resolve (`dns_failed`, retried as
    /// one): a tenant cannot list the internal host names by the answers.
    #[tokio::test]
    async fn an_internal_name_reads_as_a_name_that_does_not_resolve() {
        let client = reqwest::Client::builder()
            .no_proxy()
            .dns_resolver(crate::net::guard::GuardedResolver::new(
                crate::net::guard::UrlGuard::strict(),
            ))
            .build()
            .unwrap();
        let mut seen = Vec::new();
        // `localhost` through the resolver, past the intake's name rule.
        for url in [
            "http://localhost:9/hook",
            "http://no-such-host.invalid/hook",
        ] {
            let e = client.post(url).send().await.expect_err("refused");
            let failure = for_tenant(&e);
            assert!(
                failure.is_retryable() && failure.never_sent(),
                "{failure:?}"
            );
            seen.push(failure.envelope());
        }
        assert_eq!(seen[0], seen[1]);
        assert!(seen[0].message.starts_with("dns_failed"), "{:?}", seen[0]);
    }
}
