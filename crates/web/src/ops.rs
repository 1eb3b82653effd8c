//! Operations endpoints: `/healthz` (the process answers), `/readyz` (the platform serves) and
//! `/metrics` (Prometheus text).

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::json;

use super::AppState;

static RECORDER: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Step latencies from 1 ms to 10 s: a decode step of a small model takes milliseconds, a large
/// prefill chunk of a 3B model seconds.
const STEP_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Installs the process-wide Prometheus recorder (once; later calls return the same handle).
/// Call it before the platform starts, or the first metrics it records are lost.
/// `None` when another recorder was installed first (`/metrics` then says so).
pub fn install_metrics() -> Option<PrometheusHandle> {
    RECORDER
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full("smolchat_step_seconds".into()), STEP_BUCKETS)
                .unwrap_or_else(|_| PrometheusBuilder::new());
            match builder.install_recorder() {
                Ok(handle) => {
                    describe();
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!("metrics are disabled: {e}");
                    None
                }
            }
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!("smolchat_queue_depth", "Requests waiting for a slot");
    describe_gauge!(
        "smolchat_running_sequences",
        "Sequences being prefilled or decoded"
    );
    describe_counter!("smolchat_requests_total", "Generation requests accepted");
    describe_counter!(
        "smolchat_admin_logins_total",
        "Admin login attempts by outcome (ok, wrong, throttled, error)"
    );
    describe_counter!(
        "smolchat_generated_tokens_total",
        "Tokens generated (all sequences)"
    );
    describe_counter!(
        "smolchat_prefilled_tokens_total",
        "Prompt tokens computed (cached prefixes excluded)"
    );
    describe_counter!(
        "smolchat_spec_drafted_tokens_total",
        "Draft tokens verified by speculative decoding (scheduler.speculative)"
    );
    describe_counter!(
        "smolchat_spec_accepted_tokens_total",
        "Draft tokens the model confirmed (each one a token generated without a step of its own)"
    );
    describe_gauge!(
        "smolchat_step_fixed_seconds",
        Unit::Seconds,
        "A decode-only step's fixed cost as measured (speculative drafts pay against it)"
    );
    describe_gauge!(
        "smolchat_step_position_seconds",
        Unit::Seconds,
        "What each position adds to a decode-only step, as measured (a draft position's cost)"
    );
    describe_gauge!("smolchat_kv_bytes", Unit::Bytes, "KV cache memory in use");
    describe_gauge!(
        "smolchat_kv_budget_bytes",
        Unit::Bytes,
        "KV cache memory budget"
    );
    describe_gauge!(
        "smolchat_kv_evictions",
        "Conversation caches evicted to stay within the budget (since start)"
    );
    describe_gauge!(
        "smolchat_tokens_per_second",
        "Generated tokens per second over the last seconds"
    );
    describe_gauge!(
        "smolchat_live_sessions",
        "Conversation session actors alive"
    );
    describe_counter!(
        "smolchat_forwarded_turns_total",
        "Conversation turns sent to the replica holding their cache (forwarded), or answered here because it could not be reached (fallback)"
    );
    describe_gauge!(
        "smolchat_live_replicas",
        "Replicas alive on the shared database"
    );
    describe_histogram!(
        "smolchat_step_seconds",
        Unit::Seconds,
        "Duration of one batched model step"
    );
}

/// `GET /healthz`: 200 while the process answers at all.
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

/// `GET /readyz`: 200 while the platform can take requests (the model loads before the server
/// binds, so that is from the start until shutdown begins, as long as the model thread runs),
/// else 503.
///
/// The replica's name (by default its bind address and port) is said only to whoever may read
/// `/metrics` (this machine, or the bearer of `server.metrics_token`): anyone else learns
/// whether the server is ready and nothing of where it listens.
pub async fn readyz(state: web::Data<AppState>, req: HttpRequest) -> HttpResponse {
    let readiness = state.platform.readiness().await;
    let (model_alive, database) = (readiness.model_alive, readiness.database);
    let shutting_down = !state.ready.load(Ordering::Acquire);
    let replica = operator_may_read(&state, &req).then_some(&readiness.replica);
    if !shutting_down && model_alive && database.is_ok() {
        HttpResponse::Ok().json(json!({
            "status": "ready",
            "model": state.platform.model().id,
            "context_window": state.platform.model().context_window,
            "database": readiness.database_backend,
            "replica": replica,
        }))
    } else {
        let message = if shutting_down {
            "the server is shutting down".to_string()
        } else if !model_alive {
            "the model thread has stopped; the server cannot generate replies (see its log) \
             and must be restarted"
                .to_string()
        } else {
            format!(
                "the database cannot be reached ({}); replies cannot be saved",
                database.err().unwrap_or_default()
            )
        };
        HttpResponse::ServiceUnavailable().json(json!({
            "status": "not ready",
            "replica": replica,
            "error": { "message": message, "type": "unavailable" },
        }))
    }
}

/// Whether `req` comes from whoever may read operational detail: with `server.metrics_token`,
/// its bearer; without one, this machine (a loopback address, not through a proxy).
fn operator_may_read(state: &AppState, req: &HttpRequest) -> bool {
    let client = super::client::Client::of(req);
    match state.platform.config().server.metrics_token.as_deref() {
        Some(token) if !token.is_empty() => req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| {
                smolchat_auth::secret::matches(given, &smolchat_auth::secret::digest(token))
            }),
        _ => client.address.is_loopback() && !client.proxied,
    }
}

/// `GET /metrics`: Prometheus text exposition. With `server.metrics_token` it needs that bearer
/// (wrong ones are throttled per address like wrong API keys); without one it answers only
/// clients on this machine (a loopback address, not through a trusted proxy), so a server bound
/// to a public address does not publish its metrics by default.
pub async fn metrics(state: web::Data<AppState>, req: HttpRequest) -> HttpResponse {
    let client = super::client::Client::of(&req);
    match state.platform.config().server.metrics_token.as_deref() {
        Some(token) if !token.is_empty() => {
            if let Some(lockout) = state.bearers.locked(client.address) {
                return HttpResponse::TooManyRequests()
                    .insert_header((header::RETRY_AFTER, lockout.retry_after_s()))
                    .json(json!({
                        "error": {
                            "message": format!(
                                "too many wrong tokens from this address; try again in {} s",
                                lockout.retry_after_s()
                            ),
                            "type": "rate_limited",
                        }
                    }));
            }
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let right = given.is_some_and(|given| {
                smolchat_auth::secret::matches(given, &smolchat_auth::secret::digest(token))
            });
            if !right {
                if given.is_some() {
                    state.bearers.failed(client.address);
                }
                return HttpResponse::Unauthorized()
                    .insert_header((header::WWW_AUTHENTICATE, "Bearer"))
                    .json(json!({
                        "error": {
                            "message": "/metrics needs `Authorization: Bearer <server.metrics_token>`",
                            "type": "unauthorized",
                        }
                    }));
            }
        }
        _ if !client.address.is_loopback() || client.proxied => {
            return HttpResponse::Forbidden().json(json!({
                "error": {
                    "message": "/metrics answers only this machine until server.metrics_token \
                                is set; set it and send `Authorization: Bearer <token>`",
                    "type": "forbidden",
                }
            }));
        }
        _ => {}
    }
    let Some(handle) = &state.metrics else {
        return HttpResponse::NotFound().json(json!({
            "error": {
                "message": "metrics are disabled in this process (another metrics recorder was installed)",
                "type": "not_found",
            }
        }));
    };
    state.platform.refresh_gauges().await;
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(handle.render())
}
