//! Who is on the other end of a request: the client's address and whether it reached us over
//! HTTPS, decided once per request, and the `Host` allow-list.
//!
//! The address is what throttles, guest limits, sign-up caps, stream caps and `/v1` identities
//! count by. It is the TCP peer, unless the peer is one of `server.trusted_proxies`: then the
//! forwarding headers that proxy wrote are believed (`X-Forwarded-For`, else RFC 7239
//! `Forwarded`), walking the chain from the right and skipping trusted hops, so a client that
//! writes its own `X-Forwarded-For` in front of the proxy's entry is still seen as itself. A
//! request whose peer is not trusted never has its forwarding headers read, whatever they say.
//! (actix-web's own `connection_info()` believes those headers from anyone; nothing here uses
//! it.)
//!
//! `server.allowed_hosts` stops DNS rebinding: a page on an attacker's name that resolves to our
//! address sends its own name as `Host`. When the setting is absent, a server bound to a
//! loopback address answers only `localhost` and IP literals (where a browser on the same
//! machine is the one reachable client, and rebinding the one way in), and a server bound to any
//! other address answers every host.

use std::future::{ready, Ready};
use std::net::{IpAddr, Ipv4Addr};

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderMap};
use actix_web::middleware::Next;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest, ResponseError};
use ipnet::IpNet;
use subtle::ConstantTimeEq;

use super::error::WebError;
use super::AppState;

/// Marks a request one replica forwarded to another (see [`super::forward`]): its value, signed
/// under a key derived from `server.cookie_secret`, names the client the replica speaks for.
pub const FORWARDED: &str = "x-smolchat-forwarded-by";

/// The client of one request (set by [`resolve`] on every request).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Client {
    /// The client's address: the TCP peer, or what a trusted proxy says the client was.
    pub address: IpAddr,
    /// Whether the client's own connection was HTTPS (a trusted proxy's `X-Forwarded-Proto` or
    /// `Forwarded: proto=`; smolchat itself serves plain HTTP).
    pub https: bool,
    /// Whether the address came from a trusted proxy's forwarding header (or a replica's signed
    /// one) rather than from the TCP peer.
    pub proxied: bool,
}

impl Client {
    /// The client of a request without a peer (actix's test requests): one shared address.
    fn unknown() -> Client {
        Client {
            address: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            https: false,
            proxied: false,
        }
    }

    /// The client [`resolve`] attached to `req` (the unknown client when it did not run).
    pub fn of(req: &HttpRequest) -> Client {
        req.extensions()
            .get::<Client>()
            .copied()
            .unwrap_or_else(Client::unknown)
    }
}

/// Which hosts `Host` may name (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostPolicy {
    /// Every host (`allowed_hosts = ["*"]`, or the default on a non-loopback bind).
    Any,
    /// `localhost` and IP literals only (the default on a loopback bind).
    LocalOnly,
    /// These names (lower case; `.example.com` also allows every subdomain), `localhost` and IP
    /// literals always allowed too, so health checks by address keep working.
    Listed(Vec<String>),
}

impl HostPolicy {
    /// The policy of `server.allowed_hosts` for a server bound to `bind`.
    pub fn new(allowed: Option<&[String]>, bind: &str) -> HostPolicy {
        match allowed {
            Some(list) if list.iter().any(|h| h.trim() == "*") => HostPolicy::Any,
            Some(list) => HostPolicy::Listed(
                list.iter()
                    .map(|h| {
                        let h = h.trim().to_ascii_lowercase();
                        // `*.example.com` and `.example.com` mean the same.
                        h.strip_prefix('*').map(str::to_string).unwrap_or(h)
                    })
                    .filter(|h| !h.is_empty())
                    .collect(),
            ),
            None if bind_is_loopback(bind) => HostPolicy::LocalOnly,
            None => HostPolicy::Any,
        }
    }

    /// Whether a request naming `host` (the `Host` header or the URI's authority, with or
    /// without a port) is answered.
    pub fn allows(&self, host: Option<&str>) -> bool {
        if *self == HostPolicy::Any {
            return true;
        }
        // HTTP/1.1 requires `Host`; an HTTP/1.0 client without one names nothing to rebind.
        let Some(host) = host else {
            return true;
        };
        let name = host_name(host).to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        if name == "localhost" || name.ends_with(".localhost") || is_ip_literal(name) {
            return true;
        }
        match self {
            HostPolicy::Any => true,
            HostPolicy::LocalOnly => false,
            HostPolicy::Listed(names) => {
                names.iter().any(|allowed| match allowed.strip_prefix('.') {
                    Some(suffix) => name == suffix || name.ends_with(allowed.as_str()),
                    None => name == allowed,
                })
            }
        }
    }
}

/// The host part of a `Host` value: without the port, IPv6 literals without brackets.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    }
}

fn is_ip_literal(name: &str) -> bool {
    name.parse::<IpAddr>().is_ok()
}

/// Whether `bind` (`host:port`) listens on a loopback address only.
fn bind_is_loopback(bind: &str) -> bool {
    let host = host_name(bind);
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `server.trusted_proxies`: the addresses whose forwarding headers are believed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    /// Parses `server.trusted_proxies` (see [`smolchat_service::config::parse_proxies`]).
    pub fn parse(entries: &[String]) -> Result<TrustedProxies, String> {
        smolchat_service::config::parse_proxies(entries).map(TrustedProxies)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|net| net.contains(&ip))
    }

    /// The client of a request from `peer` with these headers (see the module documentation).
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> Client {
        let peer = canonical(peer);
        if !self.contains(peer) {
            return Client {
                address: peer,
                https: false,
                proxied: false,
            };
        }
        let chain = forwarded_for(headers);
        // From the nearest hop outwards: the first address that is not one of our proxies is
        // the client; everything left of it was written by the client and is not believed.
        let address = chain
            .iter()
            .rev()
            .copied()
            .find(|ip| !self.contains(*ip))
            // Every hop is ours (a health check from the proxy's host): the leftmost one.
            .or_else(|| chain.first().copied())
            .unwrap_or(peer);
        Client {
            address,
            https: forwarded_proto(headers).is_some_and(|p| p.eq_ignore_ascii_case("https")),
            // A request from the proxy's own host without forwarding headers is that host's.
            proxied: !chain.is_empty(),
        }
    }
}

/// IPv4-mapped IPv6 addresses as IPv4, so `127.0.0.1` in the list matches a dual-stack peer.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The addresses of `X-Forwarded-For` (every such header, in order), else of `Forwarded`'s
/// `for=` parameters. Entries that are not addresses (`unknown`, obfuscated names) are skipped.
fn forwarded_for(headers: &HeaderMap) -> Vec<IpAddr> {
    let xff: Vec<IpAddr> = headers
        .get_all("x-forwarded-for")
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(parse_node)
        .collect();
    if !xff.is_empty() {
        return xff;
    }
    headers
        .get_all(header::FORWARDED)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|element| {
            element.split(';').find_map(|pair| {
                let (k, v) = pair.split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("for")
                    .then(|| parse_node(v))
                    .flatten()
            })
        })
        .collect()
}

/// The scheme the last trusted proxy received: `X-Forwarded-Proto`, else the last `proto=`
/// of `Forwarded`.
fn forwarded_proto(headers: &HeaderMap) -> Option<String> {
    if let Some(proto) = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
    {
        // A chain of proxies may append: the nearest one's is last.
        return proto.rsplit(',').next().map(|p| p.trim().to_string());
    }
    headers
        .get_all(header::FORWARDED)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|element| {
            element.split(';').find_map(|pair| {
                let (k, v) = pair.split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("proto")
                    .then(|| v.trim().trim_matches('"').to_string())
            })
        })
        .next_back()
}

/// One node of a forwarding header: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`, `"[2001:db8::1]:80"`.
fn parse_node(node: &str) -> Option<IpAddr> {
    let node = node.trim().trim_matches('"');
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Some(rest) = node.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok().map(canonical);
    }
    let (ip, _port) = node.rsplit_once(':')?;
    ip.parse().ok().map(canonical)
}

/// Where links to this server point (share and invite links): `server.public_url` when set;
/// else the scheme the client used (a trusted proxy's `X-Forwarded-Proto` counts) and the host
/// the request named: a trusted proxy's `X-Forwarded-Host`, else `Host` (which passed
/// `server.allowed_hosts`). A forwarded host is read only from a trusted proxy and must pass
/// the allow-list too, so no client can have a link built on a host of its choosing.
pub fn public_base(state: &AppState, req: &HttpRequest) -> String {
    if let Some(url) = state.platform.config().server.public_url.as_deref() {
        return url.trim_end_matches('/').to_string();
    }
    let scheme = if Client::of(req).https {
        "https"
    } else {
        "http"
    };
    let plain = |h: &&str| {
        !h.is_empty()
            && h.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'))
    };
    let from_proxy = req
        .peer_addr()
        .is_some_and(|p| state.proxies.contains(canonical(p.ip())));
    let forwarded = from_proxy
        .then(|| {
            req.headers()
                .get("x-forwarded-host")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(',').next())
                .map(str::trim)
        })
        .flatten()
        .filter(plain)
        .filter(|h| state.hosts.allows(Some(h)));
    let own = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(plain);
    let host = forwarded
        .or(own)
        .map(str::to_string)
        .unwrap_or_else(|| state.platform.config().server.bind.clone());
    format!("{scheme}://{host}")
}

/// The request's `Host`: the header, else the URI's authority (HTTP/2).
fn host_of(req: &ServiceRequest) -> Option<&str> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
}

/// Middleware on the whole app: refuses hosts outside `server.allowed_hosts` (421 with the
/// setting to change), then attaches the request's [`Client`].
pub async fn resolve(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let Some(state) = req.app_data::<web::Data<AppState>>().cloned() else {
        return Err(WebError::Internal("application state missing".into()).into());
    };
    if !state.hosts.allows(host_of(&req)) {
        let host: String = host_of(&req).unwrap_or("").chars().take(100).collect();
        let response = WebError::MisdirectedHost(format!(
            "this server does not answer for the host {host:?}; add it to server.allowed_hosts \
             if it is one of this server's names"
        ))
        .error_response();
        return Ok(req.into_response(response).map_into_right_body());
    }
    // A turn another replica forwarded speaks, under its signature, for the client it came from.
    let forwarded = req
        .headers()
        .get(FORWARDED)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
            verify(state.cookie_key.signing(), v, req.method().as_str(), target)
        });
    let client = match (forwarded, req.peer_addr()) {
        (Some(client), _) => {
            req.extensions_mut().insert(ForwardedHere);
            client
        }
        (None, Some(peer)) => state.proxies.client(peer.ip(), req.headers()),
        (None, None) => Client::unknown(),
    };
    req.extensions_mut().insert(client);
    Ok(next.call(req).await?.map_into_left_body())
}

impl FromRequest for Client {
    type Error = WebError;
    type Future = Ready<Result<Client, WebError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(Ok(Client::of(req)))
    }
}

/// What the signature covers, and how far a forwarded request's time may be from ours.
const SIGNATURE_PURPOSE: &str = "smolchat-forward-v1";
const MAX_SKEW_MS: u64 = 60_000;

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn signed_payload(
    replica: &str,
    client: &Client,
    at_ms: u64,
    method: &str,
    target: &str,
) -> String {
    format!(
        "{replica}\n{}\n{}\n{at_ms}\n{method}\n{target}",
        client.address,
        u8::from(client.https)
    )
}

/// The [`FORWARDED`] value for a request of `client` to `method target`, sent by `replica`.
pub fn sign(key: &[u8], replica: &str, client: &Client, method: &str, target: &str) -> String {
    sign_at(key, replica, client, method, target, unix_ms())
}

fn sign_at(
    key: &[u8],
    replica: &str,
    client: &Client,
    method: &str,
    target: &str,
    at_ms: u64,
) -> String {
    let mac = smolchat_auth::secret::fingerprint(
        key,
        SIGNATURE_PURPOSE,
        &signed_payload(replica, client, at_ms, method, target),
    );
    format!(
        "v1;{replica};{};{};{at_ms};{mac}",
        client.address,
        u8::from(client.https)
    )
}

/// The client a signed [`FORWARDED`] value speaks for, or `None` when it is malformed, signed
/// with another key, for another request, or too old.
pub fn verify(key: &[u8], value: &str, method: &str, target: &str) -> Option<Client> {
    verify_at(key, value, method, target, unix_ms())
}

fn verify_at(key: &[u8], value: &str, method: &str, target: &str, now_ms: u64) -> Option<Client> {
    let mut parts = value.split(';');
    let (Some("v1"), Some(replica), Some(address), Some(https), Some(at), Some(mac), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let client = Client {
        address: address.parse().ok()?,
        https: match https {
            "1" => true,
            "0" => false,
            _ => return None,
        },
        proxied: true,
    };
    let at_ms: u64 = at.parse().ok()?;
    if now_ms.abs_diff(at_ms) > MAX_SKEW_MS {
        return None;
    }
    let expected = smolchat_auth::secret::fingerprint(
        key,
        SIGNATURE_PURPOSE,
        &signed_payload(replica, &client, at_ms, method, target),
    );
    bool::from(expected.as_bytes().ct_eq(mac.as_bytes())).then_some(client)
}

/// Set by [`resolve`] on a request that carries a valid [`FORWARDED`]: it was
/// forwarded by another replica and must be answered here.
#[derive(Clone, Copy, Debug)]
pub struct ForwardedHere;

#[cfg(test)]
mod tests {
    use actix_web::http::header::{HeaderName, HeaderValue};

    use super::*;

    #[test]
    fn only_a_fresh_signature_of_this_request_under_our_key_is_believed() {
        let key = [7u8; 32];
        let client = Client {
            address: "203.0.113.9".parse().unwrap(),
            https: true,
            proxied: false,
        };
        let t = "/api/conversations/x/messages";
        let now = 1_800_000_000_000;
        let v = sign_at(&key, "replica-a", &client, "POST", t, now);
        let got = verify_at(&key, &v, "POST", t, now + 1000).unwrap();
        assert_eq!(got.address, client.address);
        assert!(got.https);
        // Another key, request, method or a stale time: not believed.
        assert!(verify_at(&[8u8; 32], &v, "POST", t, now).is_none());
        assert!(verify_at(&key, &v, "POST", "/api/conversations/y/messages", now).is_none());
        assert!(verify_at(&key, &v, "GET", t, now).is_none());
        assert!(verify_at(&key, &v, "POST", t, now + MAX_SKEW_MS + 1).is_none());
        // A changed client address with the old signature: not believed.
        let forged = v.replace("203.0.113.9", "198.51.100.1");
        assert!(verify_at(&key, &forged, "POST", t, now).is_none());
        // What an outside client would send.
        assert!(verify_at(&key, "0190a6f4-replica-id", "POST", t, now).is_none());
        assert!(verify_at(&key, "", "POST", t, now).is_none());
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn proxies(list: &[&str]) -> TrustedProxies {
        TrustedProxies::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_writes() {
        let p = proxies(&["10.0.0.0/8"]);
        let h = headers(&[
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-proto", "https"),
        ]);
        let c = p.client(ip("198.51.100.7"), &h);
        assert_eq!(c.address, ip("198.51.100.7"));
        assert!(!c.https);
        assert!(!c.proxied);
        // No proxies configured: the same.
        let c = TrustedProxies::default().client(ip("127.0.0.1"), &h);
        assert_eq!(c.address, ip("127.0.0.1"));
    }

    #[test]
    fn a_trusted_proxy_names_the_client_and_forged_entries_are_skipped() {
        let p = proxies(&["127.0.0.1", "10.0.0.0/8"]);
        // The client wrote 1.1.1.1 itself; the proxy appended the real peer 203.0.113.9.
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1, 203.0.113.9"),
            ("x-forwarded-proto", "https"),
        ]);
        let c = p.client(ip("127.0.0.1"), &h);
        assert_eq!(c.address, ip("203.0.113.9"));
        assert!(c.https);
        assert!(c.proxied);
        // Two proxies of ours in a row.
        let h = headers(&[("x-forwarded-for", "1.1.1.1, 203.0.113.9, 10.1.2.3")]);
        assert_eq!(p.client(ip("127.0.0.1"), &h).address, ip("203.0.113.9"));
        // Several headers read in order.
        let h = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "203.0.113.10"),
        ]);
        assert_eq!(p.client(ip("127.0.0.1"), &h).address, ip("203.0.113.10"));
        // No header: the proxy's host itself.
        let own = p.client(ip("127.0.0.1"), &HeaderMap::new());
        assert_eq!(own.address, ip("127.0.0.1"));
        assert!(!own.proxied);
        // Only our own hops: the leftmost.
        let h = headers(&[("x-forwarded-for", "10.0.0.5, 10.0.0.6")]);
        assert_eq!(p.client(ip("127.0.0.1"), &h).address, ip("10.0.0.5"));
    }

    #[test]
    fn rfc_7239_forwarded_is_read_when_there_is_no_x_forwarded_for() {
        let p = proxies(&["::1"]);
        let h = headers(&[(
            "forwarded",
            "for=192.0.2.60;proto=http, for=\"[2001:db8:cafe::17]:4711\";proto=https",
        )]);
        let c = p.client(ip("::1"), &h);
        assert_eq!(c.address, ip("2001:db8:cafe::17"));
        assert!(c.https);
    }

    #[test]
    fn mapped_ipv4_peers_match_ipv4_entries() {
        let p = proxies(&["127.0.0.1"]);
        let h = headers(&[("x-forwarded-for", "203.0.113.9:5555")]);
        let c = p.client(ip("::ffff:127.0.0.1"), &h);
        assert_eq!(c.address, ip("203.0.113.9"));
    }

    #[test]
    fn bad_proxy_entries_are_named() {
        let e = TrustedProxies::parse(&["10.0.0.0/33".to_string()]).unwrap_err();
        assert!(e.contains("10.0.0.0/33"), "{e}");
        assert!(TrustedProxies::parse(&["fd00::/8".into(), "127.0.0.1".into()]).is_ok());
    }

    #[test]
    fn host_policy() {
        let local = HostPolicy::new(None, "127.0.0.1:8080");
        assert_eq!(local, HostPolicy::LocalOnly);
        assert!(local.allows(Some("127.0.0.1:8080")));
        assert!(local.allows(Some("localhost:8080")));
        assert!(local.allows(Some("[::1]:8080")));
        assert!(!local.allows(Some("evil.example:8080")));
        assert!(!local.allows(Some("localhost.evil.example")));
        assert_eq!(HostPolicy::new(None, "0.0.0.0:8080"), HostPolicy::Any);
        let listed = HostPolicy::new(
            Some(&["chat.example.com".into(), "*.corp.example".into()]),
            "0.0.0.0:80",
        );
        assert!(listed.allows(Some("chat.example.com")));
        assert!(listed.allows(Some("CHAT.example.com:443")));
        assert!(listed.allows(Some("a.corp.example")));
        assert!(listed.allows(Some("corp.example")));
        assert!(!listed.allows(Some("xcorp.example")));
        assert!(!listed.allows(Some("example.com")));
        assert!(listed.allows(Some("10.0.0.1:80")));
        let any = HostPolicy::new(Some(&["*".into()]), "127.0.0.1:80");
        assert!(any.allows(Some("anything.example")));
    }
}
