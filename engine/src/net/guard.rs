//! The SSRF guard: which addresses a URL chosen by a caller (`webhook_url`)
//! or by a model (tool calls) may reach.
//!
//! By default onceflow refuses loopback, private (RFC 1918, shared 100.64/10,
//! IPv6 ULA), link-local and cloud-metadata (169.254/16, fe80::/10),
//! unspecified (0.0.0.0/8, ::), multicast, broadcast, reserved and
//! documentation (RFC 5737, RFC 3849) addresses, and the node's own
//! interface addresses (a service bound to 0.0.0.0 answers there), in
//! every spelling the URL parser accepts (`2130706433`,
//! `0x7f.0.0.1` and `[::ffff:127.0.0.1]` are all 127.0.0.1):
//!
//! * at intake, for literal addresses and loopback names ([`UrlGuard::check`]:
//!   a `422` naming the field);
//! * at connect time, after DNS resolution, for names ([`GuardedResolver`],
//!   installed on the client that sends webhooks and tool requests): a
//!   permanent failure, the job `dead` with the reason.
//!
//! That client follows no redirects, so a 3xx cannot bounce a request
//! inward. `ONCEFLOW_ALLOW_PRIVATE_URLS=true` turns the guard off for local
//! development and tests; [`UrlGuard::allowing`] opens one exact
//! `host:port` (the loopback fakes of the `onceflow-bench` demo and benchmarks). The
//! provider URL is the operator's own and is not guarded.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

/// Which addresses outgoing caller- and model-chosen requests may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UrlGuard {
    allow_private: bool,
    /// Exact `host:port` authorities allowed whatever their address.
    allowed: Vec<String>,
}

/// A URL or address the guard refuses, with a reason fit for a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A host name that resolves only to addresses the guard refuses. The
/// caller is told no more than for a name that does not resolve
/// (`dns_failed`), or a tenant could list the internal host names by
/// their answers; the node's log keeps which kinds of address it found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RefusedName(pub String);

impl UrlGuard {
    /// The default: public addresses only.
    pub fn strict() -> Self {
        UrlGuard::default()
    }

    /// Every address allowed (`ONCEFLOW_ALLOW_PRIVATE_URLS=true`): local
    /// development and tests only.
    pub fn allow_private() -> Self {
        UrlGuard {
            allow_private: true,
            allowed: Vec::new(),
        }
    }

    /// Also allows the exact authority `host:port` (e.g. `127.0.0.1:9000`).
    pub fn allowing(mut self, authority: impl Into<String>) -> Self {
        self.allowed.push(authority.into().to_ascii_lowercase());
        self
    }

    /// Also allows the authority (`host:port`) of `url`; a URL that does not
    /// parse opens nothing.
    pub fn allowing_url(self, url: &str) -> Self {
        match url::Url::parse(url) {
            Ok(u) => match (u.host_str(), u.port_or_known_default()) {
                (Some(host), Some(port)) => self.allowing(format!("{host}:{port}")),
                _ => self,
            },
            Err(_) => self,
        }
    }

    /// Whether private addresses are allowed everywhere.
    pub fn allows_private(&self) -> bool {
        self.allow_private
    }

    fn allowed_authority(&self, url: &url::Url) -> bool {
        match (url.host_str(), url.port_or_known_default()) {
            (Some(host), Some(port)) => {
                let authority = format!("{host}:{port}").to_ascii_lowercase();
                self.allowed.contains(&authority)
            }
            _ => false,
        }
    }

    /// Checks a URL before anything is resolved: its scheme, and a literal
    /// address or loopback name in its host. Names are checked again when
    /// they resolve.
    pub fn check(&self, url: &url::Url) -> Result<(), Refused> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Refused(format!(
                "scheme {:?} is not allowed; use http or https",
                url.scheme()
            )));
        }
        if self.allow_private || self.allowed_authority(url) {
            return Ok(());
        }
        match url.host() {
            None => Err(Refused("the URL has no host".into())),
            Some(url::Host::Ipv4(ip)) => refuse_ip(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => refuse_ip(IpAddr::V6(ip)),
            Some(url::Host::Domain(name)) => {
                let name = name.trim_end_matches('.').to_ascii_lowercase();
                if name == "localhost" || name.ends_with(".localhost") {
                    Err(Refused(format!(
                        "{name} is a loopback name; onceflow does not send to loopback, private or \
                         link-local addresses (set ONCEFLOW_ALLOW_PRIVATE_URLS=true for local development)"
                    )))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Whether a resolved address may be connected to.
    pub fn permits(&self, ip: IpAddr) -> bool {
        self.allow_private || refusal(ip).is_none()
    }
}

/// Why `ip` is refused: a kind of address [`forbidden`] names, or one of
/// this node's own interfaces (a service bound to 0.0.0.0 answers on the
/// node's public address too).
fn refusal(ip: IpAddr) -> Option<&'static str> {
    refusal_among(ip, &own_addresses())
}

fn refusal_among(ip: IpAddr, own: &[IpAddr]) -> Option<&'static str> {
    forbidden(ip).or_else(|| own.contains(&ip).then_some("this node's own"))
}

/// The addresses of this node's interfaces, read again at most every 30 s.
fn own_addresses() -> Arc<Vec<IpAddr>> {
    use std::sync::Mutex;
    use std::time::{Duration, Instant};
    static CACHE: Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    match &*cache {
        Some((read, addrs)) if read.elapsed() < Duration::from_secs(30) => addrs.clone(),
        _ => {
            let addrs = Arc::new(interface_addresses());
            *cache = Some((Instant::now(), addrs.clone()));
            addrs
        }
    }
}

/// Every address of every interface of this node (empty if they cannot be
/// read).
pub fn interface_addresses() -> Vec<IpAddr> {
    let Ok(found) = nix::ifaddrs::getifaddrs() else {
        tracing::warn!(
            "cannot read this node's interface addresses; the SSRF guard cannot refuse them"
        );
        return Vec::new();
    };
    found
        .filter_map(|i| i.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect()
}

fn refuse_ip(ip: IpAddr) -> Result<(), Refused> {
    match refusal(ip) {
        None => Ok(()),
        Some(kind) => Err(Refused(format!(
            "{ip} is a {kind} address; onceflow does not send to loopback, private or link-local \
             addresses (set ONCEFLOW_ALLOW_PRIVATE_URLS=true for local development)"
        ))),
    }
}

/// Why an address is never a destination for a caller- or model-chosen
/// URL, or `None` when it is a public address.
pub fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => {
            // IPv4 inside IPv6: mapped (::ffff:a.b.c.d), compatible
            // (::a.b.c.d) and NAT64 (64:ff9b::a.b.c.d) reach the IPv4 address.
            let s = v6.segments();
            let low_v4 = Ipv4Addr::from(((s[6] as u32) << 16) | s[7] as u32);
            if let Some(v4) = v6.to_ipv4_mapped() {
                return forbidden_v4(v4);
            }
            // IPv4-compatible (::a.b.c.d), IPv4-translated (::ffff:0:a.b.c.d)
            // and NAT64 (64:ff9b::a.b.c.d) carry an IPv4 address in the low bits.
            if s[..6] == [0, 0, 0, 0, 0, 0] && !v6.is_loopback() && !v6.is_unspecified() {
                return forbidden_v4(low_v4);
            }
            if s[..6] == [0, 0, 0, 0, 0xffff, 0] {
                return forbidden_v4(low_v4);
            }
            if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
                return forbidden_v4(low_v4);
            }
            // 6to4 (2002:a.b.c.d::/48) embeds the IPv4 address after the prefix.
            if s[0] == 0x2002 {
                return forbidden_v4(Ipv4Addr::from(((s[1] as u32) << 16) | s[2] as u32));
            }
            // The local-use NAT64 prefix and Teredo tunnels lead anywhere.
            if (s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1) || (s[0] == 0x2001 && s[1] == 0) {
                return Some("translated (NAT64 local-use or Teredo)");
            }
            forbidden_v6(v6)
        }
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, _, _] = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private")
    } else if a == 100 && (64..128).contains(&b) {
        Some("shared (carrier-grade NAT)")
    } else if ip.is_link_local() {
        Some("link-local (cloud metadata)")
    } else if a == 0 {
        Some("unspecified")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if ip.is_broadcast() || a >= 240 {
        Some("reserved")
    } else if (a == 198 && (b == 18 || b == 19)) || (a == 192 && b == 0 && ip.octets()[2] == 0) {
        Some("reserved (benchmarking, IETF protocol assignments)")
    } else if (a == 192 && b == 0 && ip.octets()[2] == 2)
        || (a == 198 && b == 51 && ip.octets()[2] == 100)
        || (a == 203 && b == 0 && ip.octets()[2] == 113)
    {
        Some("reserved (documentation, RFC 5737)")
    } else {
        None
    }
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let first = ip.segments()[0];
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_unspecified() {
        Some("unspecified")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if first & 0xfe00 == 0xfc00 {
        Some("unique-local (private)")
    } else if first & 0xffc0 == 0xfe80 || first & 0xffc0 == 0xfec0 {
        Some("link-local")
    } else if first == 0x2001 && ip.segments()[1] == 0x0db8 {
        Some("reserved (documentation, RFC 3849)")
    } else {
        None
    }
}

/// A DNS resolver that drops the addresses the guard refuses, and fails the
/// connection (with [`Refused`]) when none is left: a name cannot smuggle a
/// request to a private address.
#[derive(Debug, Clone)]
pub struct GuardedResolver {
    guard: Arc<UrlGuard>,
}

impl GuardedResolver {
    /// A resolver that lets through only the addresses `guard` allows.
    pub fn new(guard: UrlGuard) -> Self {
        GuardedResolver {
            guard: Arc::new(guard),
        }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.guard.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = found
                .iter()
                .copied()
                .filter(|a| guard.permits(a.ip()))
                .collect();
            if allowed.is_empty() {
                // The kinds, never the addresses: a caller must not map the
                // internal network through error messages.
                let mut kinds: Vec<&str> = found
                    .iter()
                    .map(|a| refusal(a.ip()).unwrap_or("public"))
                    .collect();
                kinds.sort_unstable();
                kinds.dedup();
                let refused = RefusedName(format!(
                    "{host} resolves only to addresses onceflow does not send to ({})",
                    kinds.join(", ")
                ));
                return Err(Box::new(refused) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nodes_own_addresses_and_documentation_ranges_are_refused() {
        let public: IpAddr = "8.8.8.8".parse().unwrap();
        assert_eq!(refusal_among(public, &[]), None);
        assert_eq!(refusal_among(public, &[public]), Some("this node's own"));
        let own = interface_addresses();
        assert!(own.contains(&"127.0.0.1".parse().unwrap()), "{own:?}");
        for ip in &own {
            assert!(!UrlGuard::strict().permits(*ip), "{ip}");
        }
        for ip in [
            "192.0.2.7",
            "198.51.100.7",
            "203.0.113.7",
            "100.64.0.1",
            "2001:db8::1",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert!(forbidden(ip).is_some(), "{ip}");
        }
        assert!(forbidden("203.0.114.7".parse().unwrap()).is_none());
    }

    fn check(url: &str) -> Result<(), Refused> {
        UrlGuard::strict().check(&url::Url::parse(url).unwrap())
    }

    #[test]
    fn every_spelling_of_an_internal_address_is_refused() {
        for url in [
            "http://127.0.0.1/",
            "http://127.1.2.3:8080/x",
            "http://2130706433/",
            "http://0x7f.0.0.1/",
            "http://0177.0.0.1/",
            "http://0.0.0.0/",
            "http://10.1.2.3/",
            "http://172.16.0.1/",
            "http://192.168.1.1/",
            "http://100.64.0.1/",
            "http://169.254.169.254/latest/meta-data/",
            "http://224.0.0.1/",
            "http://255.255.255.255/",
            "http://[::1]/",
            "http://[::]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:a9fe:a9fe]/",
            "http://[64:ff9b::7f00:1]/",
            "http://[fd00::1]/",
            "http://[fc12::1]/",
            "http://[fe80::1]/",
            "http://[ff02::1]/",
            "http://[::ffff:0:7f00:1]/",
            "http://[2002:7f00:1::]/",
            "http://[2001:0:1::1]/",
            "http://[64:ff9b:1::1]/",
            "http://198.18.0.1/",
            "http://192.0.0.8/",
            "http://localhost:8080/",
            "http://LOCALHOST./",
            "http://api.localhost/",
        ] {
            assert!(check(url).is_err(), "{url} must be refused");
        }
        assert!(check("ftp://example.com/").is_err());
        assert!(check("file:///etc/passwd").is_err());
    }

    #[test]
    fn public_addresses_and_names_pass() {
        for url in [
            "https://example.com/hook",
            "http://93.184.216.34/",
            "https://[2606:2800:220:1::1]/",
            "http://8.8.8.8:8080/x",
        ] {
            assert!(check(url).is_ok(), "{url} must pass");
        }
    }

    /// A name is checked after it resolves: `localhost` through the
    /// resolver (not the intake's name rule) is refused with the addresses
    /// it found; with the guard open it resolves.
    #[tokio::test]
    async fn names_resolving_to_internal_addresses_are_refused() {
        use reqwest::dns::Resolve;
        let name: reqwest::dns::Name = "localhost".parse().unwrap();
        let refused = match GuardedResolver::new(UrlGuard::strict()).resolve(name).await {
            Ok(addrs) => panic!("resolved to {:?}", addrs.collect::<Vec<_>>()),
            Err(e) => e,
        };
        let refused = refused
            .downcast_ref::<RefusedName>()
            .expect("a RefusedName error");
        assert!(refused.0.contains("loopback"), "{refused}");
        assert!(
            !refused.0.contains("127.0.0.1"),
            "no addresses in the message: {refused}"
        );
        let name: reqwest::dns::Name = "localhost".parse().unwrap();
        let open = GuardedResolver::new(UrlGuard::allow_private())
            .resolve(name)
            .await
            .unwrap();
        assert!(open.into_iter().all(|a| a.ip().is_loopback()));
    }

    #[test]
    fn opening_the_guard_is_explicit_and_exact() {
        let url = url::Url::parse("http://127.0.0.1:9000/hook").unwrap();
        assert!(UrlGuard::allow_private().check(&url).is_ok());
        assert!(UrlGuard::strict()
            .allowing("127.0.0.1:9000")
            .check(&url)
            .is_ok());
        let other = url::Url::parse("http://127.0.0.1:9001/hook").unwrap();
        assert!(UrlGuard::strict()
            .allowing("127.0.0.1:9000")
            .check(&other)
            .is_err());
        assert!(UrlGuard::allow_private().permits("127.0.0.1".parse().unwrap()));
        assert!(!UrlGuard::strict().permits("127.0.0.1".parse().unwrap()));
        assert!(UrlGuard::strict().permits("93.184.216.34".parse().unwrap()));
    }
}
