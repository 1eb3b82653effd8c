//! OpenID Connect sign-in (`[auth.oidc]`): the authorization code flow with PKCE, `state` and
//! `nonce`, against the provider's discovery document and keys, through the `openidconnect`
//! crate (no JWT checks written here).
//!
//! The flow, in plain types (the web layer moves the cookie and the redirects):
//!
//! 1. [`Oidc::begin`] makes a fresh `state`, `nonce` and PKCE verifier and the provider's
//!    authorization URL. The three secrets travel to the callback in a short-lived cookie
//!    ([`Pending`], HMAC-sealed with the cookie key), so any replica can finish the sign-in.
//! 2. [`Oidc::finish`] checks the returned `state` against the cookie's (constant time), trades
//!    the code (with the PKCE verifier) at the token endpoint, and verifies the ID token:
//!    signature against the provider's keys (fetched again once when the key id is unknown:
//!    rotation), issuer, audience, expiry and the nonce. It then reads the account name and the
//!    groups from the verified claims and applies `allowed_domains` / `allowed_groups`.
//!
//! A code can be redeemed once: the provider refuses a replay, and so does the cookie check,
//! because a finished sign-in drops its cookie.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::Engine as _;
use openidconnect::core::{CoreAuthenticationFlow, CoreClient, CoreProviderMetadata};
use openidconnect::{
    AuthorizationCode, ClaimsVerificationError, ClientId, ClientSecret, CsrfToken, IssuerUrl,
    Nonce, PkceCodeChallenge, PkceCodeVerifier, RedirectUrl, RequestTokenError, Scope,
    SignatureVerificationError,
};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::secret;

/// How long a started sign-in may take before its cookie expires.
pub const PENDING_LIFETIME: Duration = Duration::from_secs(600);
/// How long the provider's discovery document and keys are kept before they are fetched again.
const METADATA_LIFETIME: Duration = Duration::from_secs(3600);
/// The HMAC purpose label of the pending sign-in cookie.
const PENDING_PURPOSE: &str = "smolchat oidc pending sign-in";
/// A provider that does not answer within this long is reported as unreachable.
const HTTP_TIMEOUT: Duration = Duration::from_secs(15);
/// The most a provider's answer (discovery, keys, tokens) may weigh.
const MAX_RESPONSE_BYTES: u64 = 1 << 20;

/// `[auth.oidc]`: the identity provider and what its answers mean here.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OidcConfig {
    /// The provider's issuer URL, exactly as its discovery document states it
    /// (`{issuer}/.well-known/openid-configuration` must exist).
    pub issuer: String,
    pub client_id: String,
    /// Better given as `SMOLCHAT_AUTH__OIDC__CLIENT_SECRET` than in a file. Without one the
    /// client is public (PKCE only).
    pub client_secret: Option<String>,
    /// This server's callback as the browser reaches it, registered at the provider:
    /// `https://chat.example.com/auth/oidc/callback`.
    pub redirect_url: String,
    /// Scopes asked for (`openid` is always added).
    pub scopes: Vec<String>,
    /// The ID token claim that names the account (`preferred_username`, `email`, `upn`…).
    pub username_claim: String,
    /// The ID token claim listing the user's groups (an array of strings, or one string).
    pub groups_claim: String,
    /// Members of this group get the admin role (checked at every sign-in); others are users.
    pub admin_group: Option<String>,
    /// When not empty, only users whose `email` claim ends in one of these domains may sign in.
    pub allowed_domains: Vec<String>,
    /// When not empty, only members of one of these groups may sign in.
    pub allowed_groups: Vec<String>,
    /// The sign-in button's text: "Sign in with {label}".
    pub label: String,
}

impl Default for OidcConfig {
    fn default() -> Self {
        OidcConfig {
            issuer: String::new(),
            client_id: String::new(),
            client_secret: None,
            redirect_url: String::new(),
            scopes: vec!["openid".into(), "profile".into(), "email".into()],
            username_claim: "preferred_username".into(),
            groups_claim: "groups".into(),
            admin_group: None,
            allowed_domains: Vec::new(),
            allowed_groups: Vec::new(),
            label: "single sign-on".into(),
        }
    }
}

impl OidcConfig {
    /// What is wrong with these settings, said so that it can be fixed.
    pub fn check(&self) -> Result<(), String> {
        IssuerUrl::new(self.issuer.clone())
            .map_err(|e| format!("auth.oidc.issuer {:?} is not a URL: {e}", self.issuer))?;
        if self.client_id.trim().is_empty() {
            return Err(
                "auth.oidc.client_id is empty (the id the provider gave this server)".into(),
            );
        }
        let redirect = url::Url::parse(&self.redirect_url).map_err(|e| {
            format!(
                "auth.oidc.redirect_url {:?} is not a URL ({e}); set it to this server's public \
                 address + /auth/oidc/callback",
                self.redirect_url
            )
        })?;
        if redirect.path() != "/auth/oidc/callback" {
            return Err(format!(
                "auth.oidc.redirect_url {:?} must end in /auth/oidc/callback (the path this server \
                 answers the provider on)",
                self.redirect_url
            ));
        }
        if self.username_claim.trim().is_empty() {
            return Err("auth.oidc.username_claim is empty".into());
        }
        Ok(())
    }
}

/// Why an OpenID Connect sign-in did not happen, in words for the person signing in.
#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    #[error("the identity provider ({issuer}) cannot be reached or its discovery document is unusable: {why}")]
    Discovery { issuer: String, why: String },
    #[error("this sign-in was not started here, or took longer than 10 minutes, or the browser dropped its cookie; start again")]
    StateMissing,
    #[error("the answer does not belong to the sign-in this browser started (state mismatch); start again")]
    StateMismatch,
    #[error("the identity provider refused the sign-in: {0}")]
    ProviderRefused(String),
    #[error("the identity provider refused the authorization code ({0}): it was already used, has expired, or belongs to another sign-in; start again")]
    CodeRefused(String),
    #[error("the identity provider's token endpoint failed: {0}")]
    TokenEndpoint(String),
    #[error("the identity provider answered without an ID token (is the `openid` scope allowed for this client?)")]
    NoIdToken,
    #[error("the ID token was refused: {0}")]
    BadIdToken(String),
    #[error(
        "the ID token carries no usable {0:?} claim to name the account (auth.oidc.username_claim)"
    )]
    NoName(String),
    #[error("{who} may not sign in here: {why}")]
    NotAllowed { who: String, why: String },
}

impl OidcError {
    /// Whether the provider (not the person) is at fault: 502 rather than 400/401/403.
    pub fn is_provider_failure(&self) -> bool {
        matches!(
            self,
            OidcError::Discovery { .. } | OidcError::TokenEndpoint(_)
        )
    }
}

/// What a started sign-in must remember until the callback (sealed into a cookie).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Pending {
    state: String,
    nonce: String,
    verifier: String,
    /// Where to go after signing in (a path on this server).
    pub next: String,
    /// Unix seconds when the sign-in started.
    started: i64,
}

impl Pending {
    /// The cookie value: base64url(JSON) + "." + HMAC(key).
    pub fn seal(&self, key: &[u8]) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        let body = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json);
        let mac = secret::fingerprint(key, PENDING_PURPOSE, &body);
        format!("{body}.{mac}")
    }

    /// The pending sign-in of a cookie value, when its seal holds and it is not too old.
    pub fn open(key: &[u8], sealed: &str) -> Option<Pending> {
        let (body, mac) = sealed.rsplit_once('.')?;
        let expected = secret::fingerprint(key, PENDING_PURPOSE, body);
        if !bool::from(expected.as_bytes().ct_eq(mac.as_bytes())) {
            return None;
        }
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .ok()?;
        let pending: Pending = serde_json::from_slice(&json).ok()?;
        let age = chrono::Utc::now().timestamp() - pending.started;
        (0..=PENDING_LIFETIME.as_secs() as i64)
            .contains(&age)
            .then_some(pending)
    }
}

/// A started sign-in: send the browser to `url`, keep `pending` in the cookie.
#[derive(Debug)]
pub struct Started {
    pub url: String,
    pub pending: Pending,
}

/// Who the provider vouched for, after every check.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    pub issuer: String,
    pub subject: String,
    /// The `username_claim`'s value, as sent (the account name is made from it).
    pub name: String,
    pub email: Option<String>,
    pub groups: Vec<String>,
    /// `Some` when `admin_group` is set: whether the user is in it.
    pub admin: Option<bool>,
}

/// The OpenID Connect client: the settings, an HTTP client and the provider's metadata.
pub struct Oidc {
    config: OidcConfig,
    http: ureq::Agent,
    metadata: Mutex<Option<(Instant, CoreProviderMetadata)>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct HttpError(String);

impl Oidc {
    pub fn new(config: OidcConfig) -> Result<Oidc, String> {
        config.check()?;
        let http: ureq::Agent = ureq::Agent::config_builder()
            // No redirects: a provider's endpoints answer directly (and a redirect to an
            // internal address must not be followed on its say-so).
            .max_redirects(0)
            // Error statuses are answers too (the token endpoint's `invalid_grant`).
            .http_status_as_error(false)
            .timeout_global(Some(HTTP_TIMEOUT))
            // The system's trust store, so a company CA works as it does for the browsers.
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                    .build(),
            )
            .build()
            .into();
        Ok(Oidc {
            config,
            http,
            metadata: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &OidcConfig {
        &self.config
    }

    /// The provider's metadata and keys: cached for an hour, fetched again when `fresh`.
    async fn metadata(&self, fresh: bool) -> Result<CoreProviderMetadata, OidcError> {
        if !fresh {
            let cached = self
                .metadata
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            if let Some((at, m)) = cached {
                if at.elapsed() < METADATA_LIFETIME {
                    return Ok(m);
                }
            }
        }
        let discovery = |why: String| OidcError::Discovery {
            issuer: self.config.issuer.clone(),
            why,
        };
        let issuer =
            IssuerUrl::new(self.config.issuer.clone()).map_err(|e| discovery(e.to_string()))?;
        let client = |req| self.send(req);
        let m = CoreProviderMetadata::discover_async(issuer, &client)
            .await
            .map_err(|e| discovery(error_chain(&e)))?;
        *self
            .metadata
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((Instant::now(), m.clone()));
        Ok(m)
    }

    /// One HTTP exchange for the `openidconnect` crate, through ureq on a blocking thread.
    async fn send(
        &self,
        request: openidconnect::HttpRequest,
    ) -> Result<openidconnect::HttpResponse, HttpError> {
        let agent = self.http.clone();
        tokio::task::spawn_blocking(move || {
            let mut res = agent.run(request).map_err(|e| HttpError(error_chain(&e)))?;
            let status = res.status();
            let headers = res.headers().clone();
            let body = res
                .body_mut()
                .with_config()
                .limit(MAX_RESPONSE_BYTES)
                .read_to_vec()
                .map_err(|e| HttpError(error_chain(&e)))?;
            let mut out = openidconnect::http::Response::builder().status(status);
            for (name, value) in &headers {
                out = out.header(name, value);
            }
            out.body(body).map_err(|e| HttpError(e.to_string()))
        })
        .await
        .map_err(|e| HttpError(format!("the request's thread failed: {e}")))?
    }

    fn client(
        &self,
        metadata: CoreProviderMetadata,
    ) -> Result<
        CoreClient<
            openidconnect::EndpointSet,
            openidconnect::EndpointNotSet,
            openidconnect::EndpointNotSet,
            openidconnect::EndpointNotSet,
            openidconnect::EndpointMaybeSet,
            openidconnect::EndpointMaybeSet,
        >,
        OidcError,
    > {
        let redirect = RedirectUrl::new(self.config.redirect_url.clone()).map_err(|e| {
            OidcError::Discovery {
                issuer: self.config.issuer.clone(),
                why: format!("auth.oidc.redirect_url: {e}"),
            }
        })?;
        Ok(CoreClient::from_provider_metadata(
            metadata,
            ClientId::new(self.config.client_id.clone()),
            self.config.client_secret.clone().map(ClientSecret::new),
        )
        .set_redirect_uri(redirect))
    }

    /// Starts a sign-in that returns to `next` (a path on this server).
    pub async fn begin(&self, next: &str) -> Result<Started, OidcError> {
        let client = self.client(self.metadata(false).await?)?;
        let (challenge, verifier) = PkceCodeChallenge::new_random_sha256();
        let mut request = client
            .authorize_url(
                CoreAuthenticationFlow::AuthorizationCode,
                CsrfToken::new_random,
                Nonce::new_random,
            )
            .set_pkce_challenge(challenge);
        for scope in &self.config.scopes {
            if scope != "openid" {
                request = request.add_scope(Scope::new(scope.clone()));
            }
        }
        let (url, state, nonce) = request.url();
        Ok(Started {
            url: url.to_string(),
            pending: Pending {
                state: state.secret().clone(),
                nonce: nonce.secret().clone(),
                verifier: verifier.secret().clone(),
                next: safe_next(next),
                started: chrono::Utc::now().timestamp(),
            },
        })
    }

    /// Finishes the sign-in `pending` started, from the callback's `code` and `state`.
    pub async fn finish(
        &self,
        pending: &Pending,
        code: &str,
        state: &str,
    ) -> Result<Verified, OidcError> {
        if !bool::from(pending.state.as_bytes().ct_eq(state.as_bytes())) {
            return Err(OidcError::StateMismatch);
        }
        let metadata = self.metadata(false).await?;
        let client = self.client(metadata)?;
        let http = |req| self.send(req);
        let exchange = client
            .exchange_code(AuthorizationCode::new(code.to_string()))
            .map_err(|e| OidcError::TokenEndpoint(e.to_string()))?
            .set_pkce_verifier(PkceCodeVerifier::new(pending.verifier.clone()));
        let tokens = exchange.request_async(&http).await.map_err(|e| match e {
            RequestTokenError::ServerResponse(r) => {
                let kind = r.error().to_string();
                let detail = r
                    .error_description()
                    .map(|d| format!("{kind}: {d}"))
                    .unwrap_or(kind.clone());
                if kind == "invalid_grant" {
                    OidcError::CodeRefused(detail)
                } else {
                    OidcError::TokenEndpoint(detail)
                }
            }
            other => OidcError::TokenEndpoint(error_chain(&other)),
        })?;
        let id_token = tokens
            .extra_fields()
            .id_token()
            .ok_or(OidcError::NoIdToken)?
            .clone();
        let nonce = Nonce::new(pending.nonce.clone());
        let verified = {
            let first = id_token
                .claims(&client.id_token_verifier(), &nonce)
                .map(|_| ());
            match first {
                // An unknown key id: the provider may have rotated its keys since they were
                // fetched. Fetch them once more and check again.
                Err(ClaimsVerificationError::SignatureVerification(
                    SignatureVerificationError::NoMatchingKey,
                )) => {
                    let client = self.client(self.metadata(true).await?)?;
                    let again = id_token
                        .claims(&client.id_token_verifier(), &nonce)
                        .map(|_| ());
                    again
                }
                other => other,
            }
        };
        verified.map_err(|e| OidcError::BadIdToken(describe_refusal(&e)))?;
        // The signature and the standard claims hold: the payload may now be read as is, for
        // the claims the crate does not model (groups, a configurable name claim).
        let claims = payload_of(&id_token.to_string())
            .ok_or_else(|| OidcError::BadIdToken("its payload is not JSON".into()))?;
        self.accept(&claims)
    }

    /// The account facts of verified `claims`, under `allowed_domains` / `allowed_groups`.
    fn accept(&self, claims: &serde_json::Value) -> Result<Verified, OidcError> {
        let text = |name: &str| {
            claims
                .get(name)
                .and_then(|v| v.as_str())
                .map(str::to_string)
        };
        let subject = text("sub").ok_or_else(|| OidcError::BadIdToken("no `sub` claim".into()))?;
        let issuer = text("iss").unwrap_or_else(|| self.config.issuer.clone());
        let name = text(&self.config.username_claim)
            .filter(|n| !n.trim().is_empty())
            .ok_or_else(|| OidcError::NoName(self.config.username_claim.clone()))?;
        let email = text("email");
        let groups: Vec<String> = match claims.get(&self.config.groups_claim) {
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .filter_map(|g| g.as_str().map(str::to_string))
                .collect(),
            Some(serde_json::Value::String(one)) => vec![one.clone()],
            _ => Vec::new(),
        };
        if !self.config.allowed_domains.is_empty() {
            let verified_email = claims
                .get("email_verified")
                .and_then(|v| v.as_bool())
                .unwrap_or(true);
            let domain = email
                .as_deref()
                .filter(|_| verified_email)
                .and_then(|e| e.rsplit_once('@'))
                .map(|(_, d)| d.to_ascii_lowercase());
            let allowed = domain.as_deref().is_some_and(|d| {
                self.config
                    .allowed_domains
                    .iter()
                    .any(|a| a.eq_ignore_ascii_case(d))
            });
            if !allowed {
                return Err(OidcError::NotAllowed {
                    who: name,
                    why: format!(
                        "a verified e-mail address in {} is needed (auth.oidc.allowed_domains)",
                        self.config.allowed_domains.join(", ")
                    ),
                });
            }
        }
        if !self.config.allowed_groups.is_empty()
            && !groups
                .iter()
                .any(|g| self.config.allowed_groups.contains(g))
        {
            return Err(OidcError::NotAllowed {
                who: name,
                why: format!(
                    "membership of {} is needed (auth.oidc.allowed_groups)",
                    self.config.allowed_groups.join(", ")
                ),
            });
        }
        let admin = self
            .config
            .admin_group
            .as_ref()
            .map(|g| groups.iter().any(|have| have == g));
        Ok(Verified {
            issuer,
            subject,
            name,
            email,
            groups,
            admin,
        })
    }
}

/// A path on this server to return to; anything else (another site, `//host`) becomes `/`.
fn safe_next(next: &str) -> String {
    let ok = next.starts_with('/')
        && !next.starts_with("//")
        && !next.starts_with("/\\")
        && !next.chars().any(|c| c.is_control());
    if ok {
        next.to_string()
    } else {
        "/".to_string()
    }
}

/// The JSON payload of a compact JWS (whose signature was checked before).
fn payload_of(jwt: &str) -> Option<serde_json::Value> {
    let payload = jwt.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Why an ID token was refused, in words a person can act on.
fn describe_refusal(e: &ClaimsVerificationError) -> String {
    match e {
        ClaimsVerificationError::SignatureVerification(s) => format!(
            "its signature does not verify against the identity provider's keys ({s}); it may be \
             forged or altered"
        ),
        ClaimsVerificationError::Expired(d) => {
            format!("it has expired ({d}); sign in again (and check this server's clock)")
        }
        ClaimsVerificationError::InvalidAudience(d) => {
            format!("it was issued to another client, not to auth.oidc.client_id ({d})")
        }
        ClaimsVerificationError::InvalidIssuer(d) => {
            format!("it was issued by another issuer than auth.oidc.issuer ({d})")
        }
        ClaimsVerificationError::InvalidNonce(d) => format!(
            "its nonce does not match the one this sign-in sent ({d}); it belongs to another \
             sign-in or was replayed"
        ),
        other => other.to_string(),
    }
}

/// An error and its sources, joined: the crate's top-level messages alone say too little.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OidcConfig {
        OidcConfig {
            issuer: "https://id.example.com".into(),
            client_id: "smolchat".into(),
            redirect_url: "https://chat.example.com/auth/oidc/callback".into(),
            admin_group: Some("chat-admins".into()),
            ..OidcConfig::default()
        }
    }

    #[test]
    fn a_pending_sign_in_opens_only_with_its_key_and_unaltered() {
        let p = Pending {
            state: "s".into(),
            nonce: "n".into(),
            verifier: "v".into(),
            next: "/c/1".into(),
            started: chrono::Utc::now().timestamp(),
        };
        let sealed = p.seal(b"key one");
        assert_eq!(Pending::open(b"key one", &sealed), Some(p.clone()));
        assert_eq!(Pending::open(b"key two", &sealed), None);
        let (body, mac) = sealed.rsplit_once('.').unwrap();
        let mut altered = body.to_string();
        altered.insert(3, 'x');
        assert_eq!(Pending::open(b"key one", &format!("{altered}.{mac}")), None);
        let old = Pending {
            started: chrono::Utc::now().timestamp() - 601,
            ..p
        };
        assert_eq!(Pending::open(b"key one", &old.seal(b"key one")), None);
    }

    #[test]
    fn only_local_paths_are_returned_to() {
        assert_eq!(safe_next("/c/abc?x=1"), "/c/abc?x=1");
        for bad in [
            "https://evil.test/",
            "//evil.test",
            "/\\evil.test",
            "",
            "c/1",
        ] {
            assert_eq!(safe_next(bad), "/", "{bad}");
        }
    }

    #[test]
    fn claims_give_the_name_groups_and_admin_role() {
        let oidc = Oidc::new(config()).unwrap();
        let v = oidc
            .accept(&serde_json::json!({
                "iss": "https://id.example.com", "sub": "42", "preferred_username": "alice",
                "email": "alice@example.com", "groups": ["staff", "chat-admins"]
            }))
            .unwrap();
        assert_eq!(v.name, "alice");
        assert_eq!(v.admin, Some(true));
        let v = oidc
            .accept(
                &serde_json::json!({"sub": "43", "preferred_username": "bob", "groups": "staff"}),
            )
            .unwrap();
        assert_eq!(
            (v.groups.clone(), v.admin),
            (vec!["staff".to_string()], Some(false))
        );
        let e = oidc.accept(&serde_json::json!({"sub": "44"})).unwrap_err();
        assert!(e.to_string().contains("preferred_username"), "{e}");
    }

    #[test]
    fn allowed_domains_and_groups_refuse_saying_which() {
        let oidc = Oidc::new(OidcConfig {
            allowed_domains: vec!["example.com".into()],
            allowed_groups: vec!["staff".into()],
            ..config()
        })
        .unwrap();
        let ok = serde_json::json!({"sub": "1", "preferred_username": "a", "email": "a@Example.com", "groups": ["staff"]});
        assert!(oidc.accept(&ok).is_ok());
        let e = oidc
            .accept(&serde_json::json!({"sub": "1", "preferred_username": "m", "email": "m@evil.test", "groups": ["staff"]}))
            .unwrap_err();
        assert!(e.to_string().contains("allowed_domains"), "{e}");
        let e = oidc
            .accept(&serde_json::json!({"sub": "1", "preferred_username": "a", "email": "a@example.com", "email_verified": false, "groups": ["staff"]}))
            .unwrap_err();
        assert!(e.to_string().contains("verified e-mail"), "{e}");
        let e = oidc
            .accept(&serde_json::json!({"sub": "1", "preferred_username": "a", "email": "a@example.com", "groups": []}))
            .unwrap_err();
        assert!(e.to_string().contains("allowed_groups"), "{e}");
    }

    #[test]
    fn bad_settings_are_named() {
        let e = OidcConfig {
            redirect_url: "https://chat.example.com/callback".into(),
            ..config()
        }
        .check()
        .unwrap_err();
        assert!(e.contains("/auth/oidc/callback"), "{e}");
        let e = OidcConfig {
            client_id: " ".into(),
            ..config()
        }
        .check()
        .unwrap_err();
        assert!(e.contains("client_id"), "{e}");
    }
}
