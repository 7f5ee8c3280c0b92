//! Who is asking: API tokens ([`Auth`]), the `Host` this server answers
//! (against DNS rebinding), and the cross-site and body-timeout refusals.

use super::*;

/// How requests are authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// Nobody is asked (an in-process API in tests and `bench`): every
    /// request sees every job.
    Off,
    /// API tokens (`Authorization: Bearer …`). With `loopback` (the server
    /// listens on a loopback address) and no live token at all, requests
    /// need none: development mode, announced at start-up. Off loopback, or
    /// once any token exists, every request needs a live one (`401`).
    /// Revoking the last token never reopens a non-loopback server.
    Tokens {
        /// The server listens on a loopback address.
        loopback: bool,
    },
}

/// Who a request acts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Who {
    /// No authentication applies: sees every job; submits jobs with no owner.
    Anyone,
    /// A token: sees its own jobs, or all of them when admin.
    Token(crate::store::tokens::Caller),
}

impl Who {
    pub(super) fn owner(self) -> Option<i64> {
        match self {
            Who::Anyone => None,
            Who::Token(c) => Some(c.token),
        }
    }

    /// The owner filter of a listing: `None` (all jobs) unless a plain token.
    pub(super) fn scope(self) -> Option<i64> {
        match self {
            Who::Anyone => None,
            Who::Token(c) if c.admin => None,
            Who::Token(c) => Some(c.token),
        }
    }

    pub(super) fn sees(self, owner: Option<i64>) -> bool {
        match self {
            Who::Anyone => true,
            Who::Token(c) => c.admin || owner == Some(c.token),
        }
    }
}

pub(super) fn unauthorized(message: &str) -> ApiError {
    error(Code::Unauthorized, message, None)
}

/// Checks the request's token (never taken from the URL).
pub(super) async fn authenticate(state: &ApiState, req: &HttpRequest) -> Result<Who, ApiError> {
    let loopback = match state.auth {
        Auth::Off => return Ok(Who::Anyone),
        Auth::Tokens { loopback } => loopback,
    };
    match req.headers().get(actix_web::http::header::AUTHORIZATION) {
        Some(value) => {
            let token = value
                .to_str()
                .ok()
                .and_then(|v| v.split_once(' '))
                // The scheme is case-insensitive (RFC 9110 §11.1).
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, token)| token.trim())
                .filter(|t| !t.is_empty());
            let Some(token) = token else {
                return Err(unauthorized(
                    "the Authorization header must be `Bearer <token>`",
                ));
            };
            match state.store.tokens().authenticate(token).await {
                Ok(Some(caller)) => Ok(Who::Token(caller)),
                Ok(None) => Err(unauthorized("the token is unknown or revoked")),
                Err(e) => Err(unavailable(e)),
            }
        }
        None if !loopback => Err(unauthorized(
            "an API token is required: send `Authorization: Bearer <token>` \
             (create one with `onceflow token create --name NAME`)",
        )),
        // A reverse proxy in front of a loopback node would open development
        // mode to the world: a proxied request needs a token.
        None if ["forwarded", "x-forwarded-for", "x-real-ip"]
            .iter()
            .any(|h| req.headers().contains_key(*h)) =>
        {
            Err(unauthorized(
                "this request came through a proxy: development mode (no tokens) answers only \
                 direct loopback requests; create a token with `onceflow token create --name NAME`",
            ))
        }
        None => match state.store.tokens().exist().await {
            Ok(false) => Ok(Who::Anyone),
            Ok(true) => Err(unauthorized(
                "an API token is required: send `Authorization: Bearer <token>`",
            )),
            Err(e) => Err(unavailable(e)),
        },
    }
}

/// The caller of a read, through the API's front door: the request's
/// `Host` is one this API answers (else `421`), and its token checks out
/// (else `401`; `503` when the database cannot say).
pub(super) struct Reader(pub(super) Who);

/// The caller of a write: as [`Reader`], and the request was not sent by
/// another site's page (else `403`).
pub(super) struct Writer(pub(super) Who);

impl actix_web::FromRequest for Reader {
    type Error = ApiError;
    type Future = futures_util::future::LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let req = req.clone();
        Box::pin(async move { extract::caller(&req, false).await.map(Reader) })
    }
}

impl actix_web::FromRequest for Writer {
    type Error = ApiError;
    type Future = futures_util::future::LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let req = req.clone();
        Box::pin(async move { extract::caller(&req, true).await.map(Writer) })
    }
}

/// Which `Host` header values the API answers; anything else is `421`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hosts {
    /// Any (an in-process API in tests).
    Any,
    /// Exactly these `host[:port]` values (lower case).
    Only(Vec<String>),
}

impl Hosts {
    /// The listen address itself, `localhost:<port>` when it is loopback,
    /// and every name in `extra` (`ONCEFLOW_ALLOWED_HOSTS`, with or
    /// without a port).
    pub fn for_listen(listen: std::net::SocketAddr, extra: &[String]) -> Hosts {
        let port = listen.port();
        let mut hosts = vec![listen.to_string()];
        if listen.ip().is_loopback() {
            hosts.push(format!("localhost:{port}"));
            if listen.is_ipv4() {
                hosts.push(format!("[::1]:{port}"));
            } else {
                hosts.push(format!("127.0.0.1:{port}"));
            }
        }
        for name in extra {
            let name = name.trim().to_ascii_lowercase();
            if name.is_empty() {
                continue;
            }
            let has_port = if name.starts_with('[') {
                name.contains("]:")
            } else {
                name.contains(':')
            };
            if has_port {
                hosts.push(name);
            } else {
                hosts.push(format!("{name}:{port}"));
                hosts.push(name);
            }
        }
        Hosts::Only(hosts)
    }

    pub(super) fn allows(&self, host: Option<&str>) -> bool {
        match self {
            Hosts::Any => true,
            Hosts::Only(list) => host.is_some_and(|h| {
                let h = h.to_ascii_lowercase();
                list.contains(&h)
            }),
        }
    }
}

/// `421` unless the request's `Host` is one this API answers.
pub(super) fn misdirected(state: &ApiState, req: &HttpRequest) -> Option<ApiError> {
    let host = req
        .headers()
        .get(actix_web::http::header::HOST)
        .and_then(|v| v.to_str().ok());
    (!state.hosts.allows(host)).then(|| {
        error(
            Code::Misdirected,
            "this server does not answer for that Host; add the name to ONCEFLOW_ALLOWED_HOSTS",
            None,
        )
    })
}

/// `403` for a browser's request sent by another site's page. Such a page
/// may send a `POST` that needs no preflight (a form, or a body-less
/// `no-cors` fetch) with the right `Host`, and on loopback with no tokens
/// nothing else would stop it from cancelling or redriving jobs. Browsers
/// name the page's origin on every such request (`Origin`, and
/// `Sec-Fetch-Site`); it must be the server itself: the request's own
/// `Host`, or a name the API answers. Clients that are not browsers send
/// neither header and pass.
pub(super) fn cross_site(state: &ApiState, req: &HttpRequest) -> Option<ApiError> {
    let headers = req.headers();
    let same = match headers.get(actix_web::http::header::ORIGIN) {
        Some(origin) => {
            let host = headers
                .get(actix_web::http::header::HOST)
                .and_then(|v| v.to_str().ok());
            origin
                .to_str()
                .ok()
                .and_then(origin_authority)
                .is_some_and(|authority| {
                    host.is_some_and(|h| h.eq_ignore_ascii_case(authority))
                        || matches!(&state.hosts, Hosts::Only(list)
                            if list.contains(&authority.to_ascii_lowercase()))
                })
        }
        // Without `Origin`, trust only a browser that says the request is
        // its own page's (or typed by the user).
        None => headers
            .get("sec-fetch-site")
            .and_then(|v| v.to_str().ok())
            .is_none_or(|site| site == "same-origin" || site == "none"),
    };
    (!same).then(|| {
        error(
            Code::CrossSite,
            "a page of another site may not call this API; \
             call it from the console or a client that is not a browser",
            None,
        )
    })
}

/// `408`: a request body (intake's or an action's) did not arrive within
/// [`Bounds::body_timeout`].
pub(super) fn body_timed_out(limits: &Bounds) -> ApiError {
    error(
        Code::BodyTimeout,
        format!(
            "the request body did not arrive within {} s",
            limits.body_timeout.as_secs_f64()
        ),
        None,
    )
}

/// `host[:port]` of an `Origin` value (`scheme://host[:port]`); `None` for
/// `null` and anything else.
pub(super) fn origin_authority(origin: &str) -> Option<&str> {
    let (scheme, authority) = origin.split_once("://")?;
    let plain = |s: &str| !s.is_empty() && !s.contains(['/', '?', '#', '@', ' ']);
    (plain(scheme) && plain(authority)).then_some(authority)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn hosts_answered_for_a_listen_address() {
        let loopback = Hosts::for_listen("127.0.0.1:8080".parse().unwrap(), &[]);
        assert!(loopback.allows(Some("127.0.0.1:8080")));
        assert!(loopback.allows(Some("LOCALHOST:8080")));
        assert!(!loopback.allows(Some("evil.example:8080")));
        assert!(!loopback.allows(Some("localhost:9090")));
        assert!(!loopback.allows(None));
        let public = Hosts::for_listen(
            "0.0.0.0:8080".parse().unwrap(),
            &["api.example.com".into(), "lb.internal:443".into()],
        );
        assert!(public.allows(Some("api.example.com")));
        assert!(public.allows(Some("api.example.com:8080")));
        assert!(public.allows(Some("lb.internal:443")));
        assert!(!public.allows(Some("localhost:8080")));
        assert!(Hosts::Any.allows(None));
    }
}
