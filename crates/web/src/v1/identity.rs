//! Whose a `/v1` request is, for every dialect: the identity the scheduler shares fairly by and
//! counts usage for, the owner stored responses belong to, and the cache partition prefixes are
//! reused within.

use super::*;

/// A hash keyed with a random value drawn once per process, so the tags made from client
/// identities (which may include an API key) reveal nothing outside this process.
pub(crate) fn process_hash(value: &impl std::hash::Hash) -> u64 {
    static KEY: OnceLock<std::hash::RandomState> = OnceLock::new();
    std::hash::BuildHasher::hash_one(KEY.get_or_init(std::hash::RandomState::new), value)
}

/// Who a request is for, for fair sharing and per-user limits in the scheduler and for usage:
/// the account of a personal API key, the holder of `server.api_key`, else the client's address
/// (IPv6 by its /64, as the throttles count). Nothing the client writes (a made-up bearer, the
/// body's `user`) changes it, so a client cannot escape its limits by naming itself anew.
pub(crate) fn client_identity(http: &HttpRequest) -> String {
    let ext = http.extensions();
    if let Some(ApiAccount { id: user, .. }) = ext.get::<ApiAccount>() {
        return user.clone();
    }
    if ext.get::<GlobalKey>().is_some() {
        return "api:server-key".to_string();
    }
    let address = smolchat_auth::ThrottleKey::address(crate::client::Client::of(http).address);
    format!("api:{:016x}", process_hash(&("address", address)))
}

/// Who a generating request is for: [`client_identity`], and the personal API key it came with.
#[derive(Clone, Debug)]
pub(crate) struct ApiUser {
    pub id: String,
    pub key: Option<String>,
}

pub(crate) fn api_user(http: &HttpRequest) -> ApiUser {
    ApiUser {
        id: client_identity(http),
        key: http
            .extensions()
            .get::<ApiAccount>()
            .and_then(|a| a.key.clone()),
    }
}

/// The owner a `/v1` caller's stored things (responses) belong to: the account of a personal
/// API key, or the one owner `api:server-key` of whoever holds `server.api_key`. `None` for an
/// anonymous caller, whose identity does not outlive the process (nothing is stored for it).
pub(crate) fn api_owner(http: &HttpRequest) -> Option<smolchat_service::Caller> {
    let ext = http.extensions();
    let address = Some(crate::client::Client::of(http).address);
    if let Some(ApiAccount { id, admin, .. }) = ext.get::<ApiAccount>() {
        return Some(smolchat_service::Caller {
            owner: id.clone(),
            admin: *admin,
            guest: false,
            address,
        });
    }
    ext.get::<GlobalKey>().map(|_| smolchat_service::Caller {
        owner: "api:server-key".to_string(),
        admin: true,
        guest: false,
        address,
    })
}

/// The cache partition of a stateless request: the client's address, the key it presented and
/// the names it gives itself (`user`, `cache_salt`). Requests reuse cached prefixes only within
/// one partition, so one client cannot probe another's prompts through `cached_tokens` or the
/// time to first token. Hashed with a key drawn at start-up, so that neither API keys nor
/// names reach the model worker's cache keys (or its debug logs).
pub(crate) fn cache_salt(http: &HttpRequest, common: &GenerationOptions) -> String {
    cache_salt_of(http, &common.cache_salt)
}

/// [`cache_salt`] for a request whose own salt is `name`.
pub(crate) fn cache_salt_of(http: &HttpRequest, name: &str) -> String {
    let ip = crate::client::Client::of(http).address;
    format!("{:016x}", process_hash(&(ip, bearer(http), name)))
}
