//! Sign-in building blocks below the web layer, in plain types (no HTTP here):
//!
//! - [`secret`]: random session tokens, their stored ids (SHA-256), constant-time credential
//!   checks over fixed-length digests, and credential fingerprints;
//! - [`throttle`]: login throttling per client address and per subject, in memory and bounded;
//! - [`admin`]: the admin sign-in service (the token from `server.admin_token`, server-side
//!   sessions in the store, throttled).
//!
//! - [`oidc`]: OpenID Connect sign-in (the code flow with PKCE through `openidconnect`);
//! - [`accounts`]: user accounts (argon2id passwords, sessions of kind `user`, personal API
//!   keys, invites), reusing all three.
//!
//! This layer sits beside the actors: it may use the store, and the web layer calls it.

pub mod accounts;
pub mod admin;
pub mod oidc;
pub mod secret;
pub mod throttle;

use smolchat_store::StoreError;

pub use accounts::{Accounts, AccountsConfig, NewApiKey, SignedIn, SignupMode};
pub use admin::{AdminAuth, NewSession, ADMIN_SUBJECT};
pub use oidc::{Oidc, OidcConfig, OidcError};
pub use throttle::{BearerThrottle, LockedBy, Lockout, LoginThrottle, ThrottleKey, ThrottlePolicy};

/// The one error type of the sign-in layer.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// Too many failed attempts: refused without looking at the credential.
    #[error("too many failed sign-in attempts ({}); try again in {} s", .0.by.describe(), .0.retry_after_s())]
    Throttled(Lockout),
    /// Too many sign-ups from this address.
    #[error("too many accounts were created from this address; try again in {} s", .0.retry_after_s())]
    TooManySignups(Lockout),
    /// The credential is wrong, or the account is disabled (sign-in says the same for both, so
    /// the answer never confirms a password).
    #[error("wrong credentials")]
    WrongCredentials,
    /// The account is disabled (for callers that already proved who they are).
    #[error("this account is disabled; ask an administrator")]
    Disabled,
    /// The account holds as many live API keys as one may.
    #[error("this account already has {0} API keys, the limit (auth.max_api_keys_per_user); revoke one first")]
    TooManyKeys(usize),
    #[error("invalid name: {0}")]
    BadName(String),
    #[error("invalid password: {0}")]
    BadPassword(String),
    #[error("that name is taken; pick another")]
    NameTaken,
    #[error("sign-up is closed on this server; ask an administrator for an account")]
    SignupClosed,
    #[error("sign-up needs a valid invite code (this one is missing, unknown, used or expired)")]
    InviteInvalid,
    #[error("no account is called {0:?}")]
    NoSuchUser(String),
    /// A personal API key that is unknown, revoked, or whose account is disabled.
    #[error("this API key is invalid, revoked, or its account is disabled")]
    KeyRefused,
    #[error("password hashing failed: {0}")]
    Hash(String),
    /// An OpenID Connect sign-in failed (the reason is for the person signing in).
    #[error(transparent)]
    Oidc(#[from] OidcError),
    /// A sign-in setting cannot be used (said at start-up).
    #[error("{0}")]
    Config(String),
    /// Password sign-in is turned off (`auth.password_login = false`).
    #[error("password sign-in is turned off on this server; sign in with {0}")]
    PasswordLoginOff(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl AuthError {
    /// Whether the store could not be used right now (full, read-only, busy, I/O): the caller
    /// should be told to try again (503), not that it did something wrong.
    pub fn is_storage_unavailable(&self) -> bool {
        matches!(self, AuthError::Store(e) if e.is_unavailable())
    }
}
