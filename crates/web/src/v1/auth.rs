//! Who may call `/v1` (and the Ollama and Anthropic routes): `server.api_key` or a personal
//! key, checked once by [`require_api_key`] for every dialect; and the admin-only fields.

use super::*;

/// The account a `/v1` request authenticated as with a personal API key (set by
/// [`require_api_key`]); its requests are attributed to it (fair sharing, usage).
#[derive(Clone, Debug)]
pub struct ApiAccount {
    pub id: String,
    pub admin: bool,
    /// The key's id (SHA-256 of the key): its own quotas (`limits.*_per_key`).
    pub key: Option<String>,
}

/// Set by [`require_api_key`] when the request presented the global `server.api_key`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GlobalKey;

/// Authenticates a `/v1` request. A bearer that equals `server.api_key` passes; one shaped like
/// a personal key (`sk-smol-…`) must be live (401 when unknown, revoked or its account disabled)
/// and attributes the request to its account. Without either, the request passes only when no
/// `server.api_key` is configured and guests are allowed (`auth.guests`): it is then anonymous,
/// counted by its client address whatever bearer it sends (an unknown bearer is not an
/// identity, or every made-up string would be a fresh user for the per-user limits).
///
/// Wrong keys are throttled per address like wrong passwords (`auth.login_free_failures_*`):
/// past the free failures, every bearer from that address gets 429 until the lockout ends.
pub(crate) async fn require_api_key(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let Some(state) = req.app_data::<web::Data<AppState>>().cloned() else {
        return Err(ApiError::internal("application state missing").into());
    };
    let client = crate::client::Client::of(req.request());
    let global = state
        .platform
        .config()
        .server
        .api_key
        .as_deref()
        .filter(|k| !k.is_empty());
    let given: Option<String> = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| token.trim().to_string())
        })
        // Anthropic's clients send the key as `x-api-key`.
        .or_else(|| {
            req.headers()
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_string())
        });
    let anonymous_allowed = global.is_none() && state.platform.config().auth.guests;
    if let Some(token) = given {
        if let Some(lockout) = state.bearers.locked(client.address) {
            return Err(ApiError::rate_limited(
                format!(
                    "too many wrong API keys from this address; try again in {} s",
                    lockout.retry_after_s()
                ),
                lockout.retry_after_s(),
            )
            .into());
        }
        // Compared as SHA-256 digests in constant time: timing says nothing about the key's
        // length or how much of a guess was right.
        if global.is_some_and(|key| {
            smolchat_auth::secret::matches(&token, &smolchat_auth::secret::digest(key))
        }) {
            req.extensions_mut().insert(GlobalKey);
            return next.call(req).await;
        }
        match state.platform.accounts().api_key_user(&token).await {
            Ok(Some(user)) => {
                let admin = user.is_admin();
                let key = smolchat_auth::accounts::api_key_id(&token);
                req.extensions_mut().insert(ApiAccount {
                    id: user.id,
                    admin,
                    key,
                });
                return next.call(req).await;
            }
            Err(smolchat_auth::AuthError::KeyRefused) => {
                state.bearers.failed(client.address);
                return Err(ApiError::unauthorized(
                    "this API key is unknown or revoked, or its account is disabled",
                )
                .into());
            }
            Err(e) => {
                return Err(ApiError::unavailable(format!("cannot check the API key ({e})")).into())
            }
            Ok(None) if !anonymous_allowed => {
                state.bearers.failed(client.address);
                return Err(ApiError::unauthorized(if global.is_some() {
                    "invalid API key"
                } else {
                    "this server has no guest access: send a personal API key (make one on \
                     /account)"
                })
                .into());
            }
            // Anonymous use is allowed: the bearer is ignored (llama-server clients send a
            // placeholder), and the request counts against its address.
            Ok(None) => {}
        }
    } else if !anonymous_allowed {
        return Err(ApiError::unauthorized(if global.is_some() {
            "missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)"
        } else {
            "this server has no guest access: send `Authorization: Bearer <key>` with a \
             personal API key (make one on /account)"
        })
        .into());
    }
    next.call(req).await
}

/// The request's `Authorization` header, as sent.
pub(crate) fn bearer(http: &HttpRequest) -> Option<Vec<u8>> {
    http.headers()
        .get(header::AUTHORIZATION)
        .or_else(|| http.headers().get("x-api-key"))
        .map(|v| v.as_bytes().to_vec())
}

/// Whether a `/v1` request speaks for an admin: when it presented the global `server.api_key`,
/// or the personal key of an account with the admin role. With no key configured and none
/// presented, `/v1` is open to anyone and nobody is an admin. The one place that decides it.
pub fn api_caller_is_admin(_state: &AppState, http: &HttpRequest) -> bool {
    let ext = http.extensions();
    ext.get::<GlobalKey>().is_some() || ext.get::<ApiAccount>().is_some_and(|a| a.admin)
}

/// Refuses what only admins may ask for (`ignore_eos`), through the one settings check.
pub(crate) fn check_admin_only(
    state: &AppState,
    http: &HttpRequest,
    common: &GenerationOptions,
) -> Result<(), ApiError> {
    smolchat_service::settings::check_ignore_eos(
        common.params.ignore_eos,
        api_caller_is_admin(state, http),
    )
    .map_err(ApiError::from_settings)
}
