//! Sign-in building blocks below the web layer, in plain types (no HTTP here):
//!
//! - [`secret`]: random session tokens, their stored ids (SHA-256), constant-time credential
//!   checks over fixed-length digests, and credential fingerprints;
//! - [`throttle`]: login throttling per client address and per subject, in memory and bounded;
//! - [`admin`]: the admin sign-in service (the token from `server.admin_token`, server-side
//!   sessions in the store, throttled).
//!
//! User accounts reuse all three: sessions of kind `user`, a throttle keyed by account name.
//! This layer sits beside the actors: it may use the store, and the web layer calls it.

pub mod admin;
pub mod secret;
pub mod throttle;

use crate::store::StoreError;

pub use admin::{AdminAuth, NewSession, ADMIN_SUBJECT};
pub use throttle::{LockedBy, Lockout, LoginThrottle, ThrottleKey, ThrottlePolicy};

/// The one error type of the sign-in layer.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// Too many failed attempts: refused without looking at the credential.
    #[error("too many failed sign-in attempts ({}); try again in {} s", .0.by.describe(), .0.retry_after_s())]
    Throttled(Lockout),
    /// The credential is wrong.
    #[error("wrong credentials")]
    WrongCredentials,
    #[error(transparent)]
    Store(#[from] StoreError),
}
