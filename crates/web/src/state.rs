//! [`AppState`]: what every handler shares, built once by [`super::run`].

use std::sync::atomic::AtomicBool;

use actix_web::cookie::Key;
use metrics_exporter_prometheus::PrometheusHandle;
use smolchat_service::platform::Platform;

use super::{client, StreamCounter};

/// What every handler shares.
pub struct AppState {
    /// Open event streams (see [`StreamCounter`]).
    pub streams: StreamCounter,
    pub platform: Platform,
    pub cookie_key: Key,
    /// False once shutdown began (`/readyz` then answers 503).
    pub ready: AtomicBool,
    pub metrics: Option<PrometheusHandle>,
    /// Forwards conversation turns to the replica holding their KV cache (see [`super::forward`]).
    pub forward: reqwest::Client,
    /// `server.trusted_proxies` (see [`client`]).
    pub proxies: client::TrustedProxies,
    /// `server.allowed_hosts` (see [`client`]).
    pub hosts: client::HostPolicy,
    /// Wrong `/v1` keys and `/metrics` tokens per client address.
    pub bearers: smolchat_auth::BearerThrottle,
}
