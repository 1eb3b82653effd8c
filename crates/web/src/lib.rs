//! The web layer: actix-web handlers over the [`Platform`]. This is the only code that knows
//! HTTP, SSE and HTML; the actors and the store below it deal in plain Rust types.
//!
//! Routes (JSON unless said otherwise; errors are `{"error": {"message", "type"}}`):
//!
//! | route | |
//! |---|---|
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | operations (see [`ops`]) |
//! | `GET /ops/models`, `POST /ops/models/{id}/{load,unload,default}` | the models, for `smolchat model` (admin token as bearer) |
//! | `GET /ops/tools`, `POST /ops/tools/call` | the tools and MCP servers; one call of a tool (admin token as bearer) |
//! | `GET/POST /ops/knowledge`, `GET /ops/knowledge/{id}`, `PUT …/sharing`, `POST …/documents?name=`, `DELETE …/documents/{doc}` | knowledge collections, for `smolchat knowledge` (admin token as bearer) |
//! | `POST /api/conversations` | create (optional settings body) → 201 |
//! | `GET /api/conversations?q=&limit=&before=` | a page of the caller's conversations, most recent first, and the `next` cursor |
//! | `GET`, `PATCH`, `DELETE /api/conversations/{id}` | one conversation with its messages |
//! | `POST /api/conversations/{id}/messages` | send `{"content"}` → 202; the reply streams on… |
//! | `GET/POST /api/knowledge`, `GET/DELETE /api/knowledge/{id}`, `PUT …/sharing`, `POST …/documents?name=`, `DELETE …/documents/{doc}`, `POST /api/knowledge/search` | collections of documents, indexed in the background and searched by keywords and vectors (see [`knowledge`]) |
//! | `POST /api/conversations/{id}/files?name=`, `GET …/files`, `DELETE …/files/{file}` | attach a file (the body; text, Markdown, code, CSV, JSON, PDF) to the next message (`"files": [ids]`), list, remove one not yet sent |
//! | `GET /api/conversations/{id}/events` | …this SSE stream (see [`events`]) |
//! | `POST /api/conversations/{id}/draft` | the message being typed, warmed in spare steps → 202 `{"outcome"}` |
//! | `POST /api/conversations/{id}/stop` | stop the running reply → `{"stopped": bool}` |
//! | `POST /api/conversations/{id}/regenerate`, `/edit` `{"content"}` | resend the last message (atomic) → 202 |
//! | `GET /api/conversations/{id}/export?format=json\|md` | download (lossless JSON, or Markdown) |
//! | `POST /api/conversations/import` | an exported conversation → 201, a new conversation |
//!
//! | `POST /api/conversations/{id}/shares`, `GET …/shares`, `DELETE …/shares/{share}` | read-only share links: make (→ `{share, url}`, the token shown once), list, revoke |
//! | `GET`, `POST /api/folders`, `PATCH`, `DELETE /api/folders/{id}` | the caller's folders (a conversation is filed with `PATCH /api/conversations/{id}` `{"folder_id"}`; also `pinned`, `archived`, `tags`) |
//! | `GET /api/conversations/tags` | the tags on the caller's conversations, with counts (lists filter with `?tag=`, `?folder=`, `?archived=true\|all`, `?pinned=`) |
//! | `GET`, `POST /api/presets`, `PATCH`, `DELETE /api/presets/{id}` | system-prompt presets: the caller's own and the shared ones (`"shared": true`, admins only) |
//! | `GET /s/{token}` | a share link's snapshot, for anyone holding it (no account; `noindex`, no referrer) |
//!
//! | `GET /`, `/c/…`, `/conversations`, `/admin…`, `/static/…` | HTML pages (see [`pages`], [`admin`]; CSRF in [`csrf`]) |
//! | `/signin`, `/signup`, `/signout`, `/account…` | accounts (see [`account`]) |
//!
//! Everything under `/api` is scoped to the caller's owner id (an account session or a signed
//! guest cookie, see [`owner`]).

pub mod account;
pub mod admin;
pub mod anthropic;
pub mod api;
pub mod client;
pub mod cookies;
pub mod csrf;
pub mod embeddings;
pub mod error;
pub mod events;
pub mod files;
pub mod oidc;

pub use events::{StreamCounter, StreamSlot};
pub mod forward;
pub mod html;
pub mod json;
pub mod knowledge;
pub mod markdown;
pub mod ollama;
pub mod openai;
pub mod ops;
pub mod organise;
pub mod owner;
pub mod pages;
pub mod responses;
mod state;
pub mod tool_steps;
pub mod typed;
pub mod v1;

pub use state::AppState;

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix_web::middleware::from_fn;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};

pub use error::WebError;
use json::BodyLimit;
use smolchat_service::platform::Platform;

/// How long a graceful shutdown waits for open connections after the replies are stored.
const SHUTDOWN_TIMEOUT_S: u64 = 3;

/// The largest body `POST /api/conversations/import` reads (an exported conversation).
pub const IMPORT_BODY_LIMIT: usize = 32 << 20;

/// The largest JSON body: a message at the character limit written entirely in the most
/// expensive JSON escapes (`\uXXXX\uXXXX`, 12 bytes per char), plus room for the other fields.
pub fn json_limit(max_message_chars: usize) -> usize {
    max_message_chars
        .saturating_mul(12)
        .saturating_add(64 << 10)
}

/// Checks the web layer's part of the configuration, so a bad value fails at start-up before
/// the model is loaded.
pub fn check_config(config: &smolchat_service::config::Config) -> Result<(), String> {
    if let Some(secret) = &config.server.cookie_secret {
        owner::cookie_key(secret)?;
    }
    if let Some(name) = &config.auth.initial_admin {
        smolchat_auth::accounts::check_name(name)
            .map_err(|e| format!("auth.initial_admin: {e}"))?;
    }
    if let Some(password) = &config.auth.initial_admin_password {
        smolchat_auth::accounts::check_password(password)
            .map_err(|e| format!("auth.initial_admin_password: {e}"))?;
    }
    Ok(())
}

/// Headers every JSON API answer (`/api`, `/v1`) gets unless it sets its own: about one caller,
/// so never cached by anyone, and never sniffed as something other than its type.
pub fn api_headers() -> actix_web::middleware::DefaultHeaders {
    use actix_web::http::header;
    actix_web::middleware::DefaultHeaders::new()
        .add((header::CACHE_CONTROL, "no-store"))
        .add((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
}

/// Registers every route on an app whose data holds a `web::Data<AppState>`. `chat_limit` is
/// the JSON body limit of `/v1/chat/completions`, whose messages may carry files.
pub fn routes(cfg: &mut web::ServiceConfig, chat_limit: BodyLimit) {
    cfg.service(
        web::resource("/healthz")
            .route(web::get().to(ops::healthz))
            .route(web::head().to(ops::healthz))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/readyz")
            .route(web::get().to(ops::readyz))
            .route(web::head().to(ops::readyz))
            .default_service(web::to(method_not_allowed)),
    )
    .service(web::resource("/ops/models").route(web::get().to(admin::ops_list)))
    .service(web::resource("/ops/tools").route(web::get().to(admin::ops_tools)))
    .configure(knowledge::ops_routes)
    .service(web::resource("/ops/tools/call").route(web::post().to(admin::ops_tool_call)))
    .service(web::resource("/ops/models/{id}/{action}").route(web::post().to(admin::ops_action)))
    .service(
        web::resource("/metrics")
            .route(web::get().to(ops::metrics))
            .default_service(web::to(method_not_allowed)),
    )
    // Before the `/v1` scope, which would take their paths.
    .configure(anthropic::routes)
    .configure(responses::routes)
    .configure(embeddings::routes)
    // Early, so that a catch-all scope registered later cannot shadow `/v1`.
    .configure(|cfg| openai::routes(cfg, chat_limit))
    // Before the `/api` scope, which would take these paths.
    .configure(ollama::routes)
    .service(
        web::scope("/api")
            .wrap(from_fn(csrf::check_api_origin))
            .wrap(from_fn(owner::api_owner))
            .wrap(api_headers())
            .service(
                web::resource("/tools")
                    .route(web::get().to(api::tools))
                    .default_service(web::to(method_not_allowed)),
            )
            .configure(knowledge::routes)
            .service(
                web::resource("/conversations")
                    .route(web::get().to(api::list))
                    .route(web::post().to(api::create))
                    .default_service(web::to(method_not_allowed)),
            )
            // Before `/conversations/{id}`, which would otherwise take "tags" for an id (and
            // not `/api/tags`: that is Ollama's model list).
            .service(
                web::resource("/conversations/tags")
                    .route(web::get().to(organise::tags))
                    .default_service(web::to(method_not_allowed)),
            )
            // Before `/conversations/{id}`, which would otherwise take "import" for an id.
            .service(
                web::resource("/conversations/import")
                    // An export holds many messages: a larger body than a message.
                    .app_data(BodyLimit(IMPORT_BODY_LIMIT))
                    .route(web::post().to(api::import))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}")
                    .route(web::get().to(api::get))
                    .route(web::patch().to(api::patch))
                    .route(web::delete().to(api::delete))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/messages")
                    .route(web::post().to(api::send_message))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/draft")
                    .route(web::post().to(api::warm_draft))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/files")
                    .route(web::get().to(files::list))
                    .route(web::post().to(files::upload))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/files/{file}")
                    .route(web::delete().to(files::remove))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/stop")
                    .route(web::post().to(api::stop))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/tools/decide")
                    .route(web::post().to(api::decide_tool))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/regenerate")
                    .route(web::post().to(api::regenerate))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/shares")
                    .route(web::get().to(api::list_shares))
                    .route(web::post().to(api::create_share))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/shares/{share}")
                    .route(web::delete().to(api::revoke_share))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/select")
                    .route(web::post().to(api::select))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/edit")
                    .route(web::post().to(api::edit))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/export")
                    .route(web::get().to(api::export))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/conversations/{id}/events")
                    .route(web::get().to(events::events))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/folders")
                    .route(web::get().to(organise::folders))
                    .route(web::post().to(organise::create_folder))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/folders/{id}")
                    .route(web::patch().to(organise::rename_folder))
                    .route(web::delete().to(organise::delete_folder))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/presets")
                    .route(web::get().to(organise::presets))
                    .route(web::post().to(organise::create_preset))
                    .default_service(web::to(method_not_allowed)),
            )
            .service(
                web::resource("/presets/{id}")
                    .route(web::patch().to(organise::update_preset))
                    .route(web::delete().to(organise::delete_preset))
                    .default_service(web::to(method_not_allowed)),
            )
            .default_service(web::to(not_found)),
    )
    .route("/static/{path:.*}", web::get().to(pages::static_file))
    // Share links: public (no owner cookie, no account), read-only snapshots.
    .service(
        web::resource("/s/{token}")
            .route(web::get().to(pages::shared))
            .route(web::head().to(pages::shared))
            .default_service(web::to(method_not_allowed)),
    )
    // The HTML pages (see [`pages`], [`admin`]), CSRF-checked inside the owner cookie. Scopes
    // with real prefixes, not `""`, so routes registered after these still match.
    .service(
        web::resource("/")
            .wrap(from_fn(csrf::require_token))
            .wrap(from_fn(owner::chat_owner))
            .route(web::get().to(pages::index))
            // HEAD is GET without the body (actix-http drops it); probes and link checkers
            // send it.
            .route(web::head().to(pages::index))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/conversations")
            .wrap(from_fn(csrf::require_token))
            .wrap(from_fn(owner::chat_owner))
            .route(web::get().to(pages::list)),
    )
    .service(
        web::scope("/c")
            .wrap(from_fn(csrf::require_token))
            .wrap(from_fn(owner::chat_owner))
            .route("", web::post().to(pages::create))
            .route("/{id}", web::get().to(pages::conversation))
            .route("/{id}", web::delete().to(pages::delete))
            .route("/{id}/m/{mid}", web::get().to(pages::message))
            .route("/{id}/messages", web::post().to(pages::send))
            .route("/{id}/draft", web::post().to(pages::draft))
            .route("/{id}/stop", web::post().to(pages::stop))
            .route("/{id}/tools/decide", web::post().to(pages::decide_tool))
            .route("/{id}/regenerate", web::post().to(pages::regenerate))
            .route("/{id}/edit", web::post().to(pages::edit))
            .route("/{id}/select", web::post().to(pages::select))
            .route("/{id}/share", web::post().to(pages::share))
            .route(
                "/{id}/shares/{share}/revoke",
                web::post().to(pages::revoke_share),
            )
            .route("/{id}/rename", web::post().to(pages::rename))
            .route("/{id}/settings", web::post().to(pages::settings))
            .route("/{id}/thinking", web::post().to(pages::thinking))
            .route("/{id}/model", web::post().to(pages::model))
            .route("/{id}/export.json", web::get().to(pages::export_json))
            .route("/{id}/export.md", web::get().to(pages::export_md)),
    )
    // Accounts: sign-in, sign-up, sign-out, the account page.
    .configure(account::routes)
    .configure(knowledge::page_routes)
    // OpenID Connect sign-in (the provider's redirects carry no CSRF token: state does that).
    .configure(oidc::routes)
    .service(
        web::scope("/admin")
            .wrap(from_fn(csrf::require_token))
            .wrap(from_fn(owner::owner_cookie))
            .route("", web::get().to(admin::page))
            .route("/login", web::post().to(admin::login))
            .route("/logout", web::post().to(admin::logout))
            .route("/live", web::get().to(admin::live))
            .route("/c/{id}/stop", web::post().to(admin::stop))
            .route("/c/{id}/evict", web::post().to(admin::evict))
            .route("/c/{id}", web::delete().to(admin::delete))
            .route("/models/{id}/{action}", web::post().to(admin::model_action))
            .route("/users", web::post().to(admin::create_user))
            .route("/invites", web::post().to(admin::create_invite))
            .route("/invites/{id}/revoke", web::post().to(admin::revoke_invite))
            // Before `/users/{id}/{action}`, which would take "delete" for an action.
            .route("/users/{id}/delete", web::post().to(admin::delete_user))
            .route(
                "/users/{id}/reset-password",
                web::post().to(admin::reset_password),
            )
            .route("/users/{id}/usage", web::get().to(admin::user_usage))
            .route("/users/{id}/{action}", web::post().to(admin::user_action))
            .route("/audit", web::get().to(admin::audit))
            .route("/audit.{format}", web::get().to(admin::audit_export)),
    );
}

/// The longest request target (path and query) accepted, in bytes: what common servers allow
/// (nginx's default header buffer is 8 KiB). Longer ones get 414 with a message. Targets over
/// 64 KiB never reach the application: actix-http refuses them itself with an empty 400.
pub const MAX_URL_BYTES: usize = 8 << 10;

async fn limit_url(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    let len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if len > MAX_URL_BYTES {
        return Err(WebError::UriTooLong(format!(
            "the URL is {len} bytes long; the limit is {MAX_URL_BYTES}"
        ))
        .into());
    }
    next.call(req).await
}

/// The error answer of actix's own extractors (`Path`, `Query`, `Form`, `Json`): the project's
/// error shape, naming the extractor's complaint, instead of actix's plain text.
fn extractor_error(what: &'static str) -> impl Fn(String) -> actix_web::Error + Clone {
    move |detail| WebError::BadRequest(format!("{what}: {detail}")).into()
}

async fn not_found(req: HttpRequest) -> Result<HttpResponse, WebError> {
    Err(WebError::NotFound(format!(
        "no route for {} {}",
        req.method(),
        req.path()
    )))
}

async fn method_not_allowed(req: HttpRequest) -> Result<HttpResponse, WebError> {
    Err(WebError::MethodNotAllowed(format!(
        "{} is not allowed on {}",
        req.method(),
        req.path()
    )))
}

/// Serves `platform` until SIGINT or SIGTERM, then shuts down gracefully: `/readyz` turns 503,
/// running replies are stopped and stored as `stopped`, sessions end (closing their event
/// streams), and the server waits briefly for open requests. Must run inside an actix system.
pub async fn run(platform: Platform) -> io::Result<()> {
    let metrics = ops::install_metrics();
    // The platform fills the secret in (generated into the data folder, or random for a
    // database in memory) when the configuration has none.
    let secret = platform
        .config()
        .server
        .cookie_secret
        .as_deref()
        .unwrap_or_default();
    let cookie_key =
        owner::cookie_key(secret).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let bind = platform.config().server.bind.clone();
    let limit = BodyLimit(json_limit(platform.config().limits.max_message_chars));
    // A chat request may carry one largest file as base64 (4/3 of its size) beside its text.
    let chat_limit = BodyLimit(limit.0.saturating_add(
        (platform.config().limits.max_file_mib as usize * (1 << 20)) / 3 * 4 + 1024,
    ));
    let body_timeout =
        json::BodyTimeout(Duration::from_secs(platform.config().limits.body_timeout_s));
    let limits = platform.config().limits.clone();
    let limits_auth = platform.config().auth.clone();
    let proxies = client::TrustedProxies::parse(&platform.config().server.trusted_proxies)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let hosts = client::HostPolicy::new(
        platform.config().server.allowed_hosts.as_deref(),
        &platform.config().server.bind,
    );
    let state = web::Data::new(AppState {
        streams: StreamCounter::default(),
        platform,
        cookie_key,
        ready: AtomicBool::new(true),
        metrics: metrics.clone(),
        forward: forward::client(),
        proxies,
        hosts,
        // Four times a sign-in's free failures: a script with a stale key retries, and a whole
        // office behind one address should not be locked out of /v1 by it at once.
        bearers: smolchat_auth::BearerThrottle::new(smolchat_auth::ThrottlePolicy {
            free_per_address: limits_auth
                .login_free_failures_per_address
                .saturating_mul(4),
            ..smolchat_service::platform::throttle_policy(&limits_auth)
        }),
    });
    // The heartbeat reports the open streams (weakly held: the state owns the platform).
    let counted = std::sync::Arc::downgrade(&state.clone().into_inner());
    state
        .platform
        .cluster()
        .attach_stream_count(std::sync::Arc::new(move || {
            counted.upgrade().map_or(0, |s| s.streams.total())
        }));

    if let Some(handle) = metrics {
        // Histograms are drained into their buckets by upkeep; without it they grow unbounded.
        actix_web::rt::spawn(async move {
            let mut tick = actix_web::rt::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        });
    }

    let app_state = state.clone();
    let http = HttpServer::new(move || {
        let path_error = extractor_error("bad URL path");
        let query_error = extractor_error("bad query string");
        let form_error = extractor_error("bad form");
        let json_error = extractor_error("bad JSON body");
        App::new()
            .app_data(app_state.clone())
            .app_data(limit)
            .app_data(body_timeout)
            .app_data(
                web::PathConfig::default().error_handler(move |e, _| path_error(e.to_string())),
            )
            .app_data(
                web::QueryConfig::default().error_handler(move |e, _| query_error(e.to_string())),
            )
            .app_data(
                web::FormConfig::default().error_handler(move |e, _| form_error(e.to_string())),
            )
            .app_data(
                web::JsonConfig::default().error_handler(move |e, _| json_error(e.to_string())),
            )
            .wrap(from_fn(forward::affinity))
            // Outside the affinity check, which passes the client on to the owning replica.
            .wrap(from_fn(client::resolve))
            // Nothing we send is to be sniffed as another type (answers that set it keep it).
            .wrap(
                actix_web::middleware::DefaultHeaders::new()
                    .add((actix_web::http::header::X_CONTENT_TYPE_OPTIONS, "nosniff")),
            )
            .wrap(from_fn(limit_url))
            .configure(|cfg| routes(cfg, chat_limit))
            .default_service(web::to(not_found))
    })
    // Slow or idle clients must not hold connections for ever (body reads have their own limit,
    // `limits.body_timeout_s`, in the body readers).
    .client_request_timeout(Duration::from_secs(limits.request_head_timeout_s))
    .keep_alive(Duration::from_secs(limits.keep_alive_s))
    .max_connections(limits.max_connections)
    // Signals are handled below, so replies can be stopped and stored before the server stops.
    .disable_signals()
    .shutdown_timeout(SHUTDOWN_TIMEOUT_S)
    .bind(&bind)
    .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {bind}: {e}")))?;
    for addr in http.addrs() {
        tracing::info!("smolchat is listening on http://{addr}");
    }
    let server = http.run();
    let handle = server.handle();
    let stopping = state.clone();
    actix_web::rt::spawn(async move {
        let signal = shutdown_signal().await;
        tracing::info!("{signal} received; shutting down");
        stopping.ready.store(false, Ordering::Release);
        stopping.platform.drain().await;
        handle.stop(true).await;
    });
    server.await?;
    state.platform.close().await;
    tracing::info!("smolchat stopped");
    Ok(())
}

/// Resolves with the signal's name on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                Ok(()) = tokio::signal::ctrl_c() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            },
            Err(e) => {
                tracing::warn!("cannot watch SIGTERM ({e}); only Ctrl-C stops the server");
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initial_admin_must_be_a_valid_account() {
        let with = |name: &str, password: &str| {
            let mut c = smolchat_service::config::Config::default();
            c.auth.initial_admin = Some(name.into());
            c.auth.initial_admin_password = Some(password.into());
            check_config(&c)
        };
        assert!(with("root", "long enough").is_ok());
        let short = with("root", "short").unwrap_err();
        assert!(short.contains("auth.initial_admin_password"), "{short}");
        let bad = with("bad name!", "long enough").unwrap_err();
        assert!(bad.contains("auth.initial_admin:"), "{bad}");
    }
}
