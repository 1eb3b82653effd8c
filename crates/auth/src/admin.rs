//! The admin sign-in service: checks a token against `server.admin_token` (throttled, constant
//! time), and makes, checks and revokes the server-side sessions the admin cookie stands for.
//!
//! A session is valid while it is in the store unrevoked and unexpired **and** was made under
//! the current admin token (its fingerprint matches), so restarting with another token ends
//! every admin session, and sign-out ends the session for every copy of the cookie. A copied
//! cookie still works from anywhere until then, as with any bearer cookie; that is what the
//! short expiry, HttpOnly, SameSite=Strict and Secure are for.

use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::secret;
use super::throttle::{LoginThrottle, ThrottleKey, ThrottlePolicy};
use super::AuthError;
use smolchat_store::{SessionKind, SessionRecord, Store};

/// The subject of admin sessions (and the throttle's subject key for the admin token). User
/// sessions use the user's id, so this cannot collide with an account.
pub const ADMIN_SUBJECT: &str = "admin";
/// The fingerprint's purpose label, so the admin token's fingerprint can never equal that of
/// another credential under the same key.
const FINGERPRINT_PURPOSE: &str = "smolchat admin token";

/// A session just made: the token goes into the cookie, and nowhere else.
#[derive(Debug)]
pub struct NewSession {
    pub token: String,
    /// How long the session lasts (the cookie's Max-Age).
    pub lifetime: Duration,
}

pub struct AdminAuth {
    store: Store,
    token_digest: [u8; 32],
    fingerprint: String,
    lifetime: Duration,
    throttle: Mutex<LoginThrottle>,
}

impl AdminAuth {
    /// `token` is `server.admin_token` (not empty); `key` keys the token's fingerprint (the
    /// cookie key, which the server keeps across restarts).
    pub fn new(
        store: Store,
        token: &str,
        key: &[u8],
        lifetime: Duration,
        policy: ThrottlePolicy,
    ) -> AdminAuth {
        AdminAuth {
            store,
            token_digest: secret::digest(token),
            fingerprint: secret::fingerprint(key, FINGERPRINT_PURPOSE, token),
            lifetime,
            throttle: Mutex::new(LoginThrottle::new(policy)),
        }
    }

    fn throttle(&self) -> std::sync::MutexGuard<'_, LoginThrottle> {
        // The throttle's state is consistent between its method calls, none of which panics
        // half-way; a poisoned lock still holds usable counts.
        self.throttle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Signs in with `given` from `client`: refused while the address or the admin subject is
    /// locked (without looking at `given`), [`AuthError::WrongCredentials`] for a wrong token,
    /// else a new session.
    pub async fn login(&self, given: &str, client: IpAddr) -> Result<NewSession, AuthError> {
        self.check_bearer(given, client)?;
        let (token, id) = secret::new_session();
        let lifetime = chrono::Duration::from_std(self.lifetime).unwrap_or(chrono::Duration::MAX);
        self.store
            .create_session(
                &id,
                SessionKind::Admin,
                ADMIN_SUBJECT,
                &self.fingerprint,
                lifetime,
            )
            .await?;
        // Housekeeping where it costs nothing noticeable: sign-ins are rare.
        match self.store.purge_expired_sessions().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(purged = n, "expired sessions purged"),
            Err(e) => tracing::warn!("cannot purge expired sessions: {e}"),
        }
        Ok(NewSession {
            token,
            lifetime: self.lifetime,
        })
    }

    /// Checks `given` as the admin token, throttled per address and for the admin subject:
    /// refused while locked (without looking at `given`), [`AuthError::WrongCredentials`] for a
    /// wrong token. A sign-in and a bearer (`smolchat model`, no session made) both pass here.
    pub fn check_bearer(&self, given: &str, client: IpAddr) -> Result<(), AuthError> {
        let keys = [
            ThrottleKey::address(client),
            ThrottleKey::subject(ADMIN_SUBJECT),
        ];
        self.throttle()
            .attempt(&keys, Instant::now())
            .map_err(AuthError::Throttled)?;
        if !secret::matches(given, &self.token_digest) {
            return Err(AuthError::WrongCredentials);
        }
        self.throttle().success(&keys, Instant::now());
        Ok(())
    }

    /// The admin session `token` (a cookie value) stands for, if it is valid now.
    pub async fn session(&self, token: &str) -> Result<Option<SessionRecord>, AuthError> {
        let Some(id) = secret::session_id(token) else {
            return Ok(None);
        };
        Ok(self
            .store
            .valid_session(&id, SessionKind::Admin, &self.fingerprint)
            .await?)
    }

    /// Signs out: revokes the session `token` stands for, for every copy of the cookie.
    /// `false` when there was no live session.
    pub async fn logout(&self, token: &str) -> Result<bool, AuthError> {
        let Some(id) = secret::session_id(token) else {
            return Ok(false);
        };
        Ok(self.store.revoke_session(&id).await?)
    }

    /// Revokes every admin session (e.g. after the token leaked); returns how many.
    pub async fn revoke_all(&self) -> Result<u64, AuthError> {
        Ok(self
            .store
            .revoke_sessions_of(SessionKind::Admin, ADMIN_SUBJECT)
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::LockedBy;

    fn auth(token: &str, key: &[u8], store: Store) -> AdminAuth {
        AdminAuth::new(
            store,
            token,
            key,
            Duration::from_secs(3600),
            ThrottlePolicy {
                free_per_address: 2,
                free_per_subject: 100,
                base_lockout: Duration::from_secs(600),
                ..ThrottlePolicy::default()
            },
        )
    }

    const HOME: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn sessions_are_distinct_revocable_and_bound_to_the_token() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        let admin = auth("tok", b"key", store.clone());
        let a = admin.login("tok", HOME).await.unwrap();
        let b = admin.login("tok", HOME).await.unwrap();
        assert_ne!(a.token, b.token, "every sign-in gets its own token");
        assert!(admin.session(&a.token).await.unwrap().is_some());
        // Only the hash is stored.
        let id = secret::session_id(&a.token).unwrap();
        let row = store.get_session(&id).await.unwrap().unwrap();
        assert_eq!(row.kind, SessionKind::Admin);
        assert_eq!(row.subject, ADMIN_SUBJECT);
        assert!(store.get_session(&a.token).await.unwrap().is_none());

        assert!(admin.logout(&a.token).await.unwrap());
        assert!(admin.session(&a.token).await.unwrap().is_none());
        assert!(!admin.logout(&a.token).await.unwrap(), "already revoked");
        assert!(admin.session(&b.token).await.unwrap().is_some());

        // Same store, another token (or another key): old sessions are refused.
        let changed = auth("tok2", b"key", store.clone());
        assert!(changed.session(&b.token).await.unwrap().is_none());
        let rekeyed = auth("tok", b"other key", store.clone());
        assert!(rekeyed.session(&b.token).await.unwrap().is_none());
        // And the original configuration still accepts it.
        assert!(admin.session(&b.token).await.unwrap().is_some());
        assert_eq!(admin.revoke_all().await.unwrap(), 1);
        assert!(admin.session(&b.token).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn wrong_tokens_lock_the_address_even_for_the_right_one() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        let admin = auth("tok", b"key", store);
        for wrong in ["", "to"] {
            assert!(matches!(
                admin.login(wrong, HOME).await,
                Err(AuthError::WrongCredentials)
            ));
        }
        match admin.login("tok", HOME).await {
            Err(AuthError::Throttled(l)) => {
                assert_eq!(l.by, LockedBy::Address);
                assert!(l.retry_after_s() > 590, "{l:?}");
            }
            other => panic!("expected a lockout, got {other:?}"),
        }
        // Another address signs in.
        let elsewhere = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));
        assert!(admin.login("tok", elsewhere).await.is_ok());
        assert!(matches!(
            admin.login("tok", HOME).await,
            Err(AuthError::Throttled(_))
        ));
    }

    #[tokio::test]
    async fn junk_cookies_are_no_session() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        let admin = auth("tok", b"key", store);
        for junk in ["", "admin-v1", &"0".repeat(64), &"z".repeat(64)] {
            assert!(admin.session(junk).await.unwrap().is_none(), "{junk:?}");
            assert!(!admin.logout(junk).await.unwrap());
        }
    }
}
