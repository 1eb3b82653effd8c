//! User accounts: sign-up, sign-in, server-side sessions, password changes, personal API keys
//! and invites, in plain types (the web layer moves cookies and renders).
//!
//! - Passwords are hashed with argon2id (the `argon2` crate's defaults, a random salt each) and
//!   verified on a blocking thread (`spawn_blocking`), so a sign-in never stalls the event loop.
//!   They are never logged; 8 characters to 1024 bytes.
//! - A session is a row of `sessions` (kind `user`, subject = the user id); the cookie holds a
//!   random token, the row its SHA-256. Its fingerprint is a keyed hash (HMAC under the cookie
//!   key) of the account's password *hash*, so a changed password ends every older session even
//!   if the explicit revocation that goes with it were missed.
//! - A disabled account's sessions and API keys are refused on every lookup (the store checks
//!   `disabled_at` each time), and disabling revokes its sessions as well.
//! - Sign-in is throttled per client address and per account name ([`LoginThrottle`]). An
//!   unknown name costs one argon2 verification of a dummy hash, so the time taken does not say
//!   which names exist.
//! - API keys are `sk-smol-` + 64 hex characters; the store keeps their SHA-256 and a short
//!   display prefix. Invite codes are 64 hex characters, stored the same way, single use, with an
//!   expiry.

use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use subtle::ConstantTimeEq;

use super::admin::NewSession;
use super::secret;
use super::throttle::{LoginThrottle, ThrottleKey, ThrottlePolicy};
use super::AuthError;
use smolchat_store::{ApiKeyRecord, CreatedUser, NewUser, SessionKind, Store, User, UserRole};

/// Shortest password, in characters.
pub const MIN_PASSWORD_CHARS: usize = 8;
/// Longest password, in bytes (argon2 takes any length; this bounds the work a request asks).
pub const MAX_PASSWORD_BYTES: usize = 1024;
/// Longest account name, in characters.
pub const MAX_NAME_CHARS: usize = 64;
/// The issuer under which a trusted proxy's user header is linked to accounts
/// (`user_identities`), as an OpenID Connect provider's identities are under its issuer URL.
pub const TRUSTED_HEADER_ISSUER: &str = "trusted-header";
/// The longest value of the trusted proxy's user header taken, in characters.
pub const MAX_TRUSTED_VALUE_CHARS: usize = 256;
/// What every personal API key starts with, so a key is recognisable (and secret scanners can
/// find leaked ones).
pub const API_KEY_PREFIX: &str = "sk-smol-";
/// Characters of a key shown in lists (`sk-smol-` and 6 hex digits).
const DISPLAY_PREFIX_CHARS: usize = 14;
/// The fingerprint's purpose label (see [`secret::fingerprint`]).
const FINGERPRINT_PURPOSE: &str = "smolchat password hash";

/// Checks an account name: 1–64 characters of ASCII letters, digits, `.`, `_` and `-`.
pub fn check_name(name: &str) -> Result<(), AuthError> {
    if name.is_empty() || name.chars().count() > MAX_NAME_CHARS {
        return Err(AuthError::BadName(format!(
            "a name has 1 to {MAX_NAME_CHARS} characters"
        )));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(AuthError::BadName(
            "a name may only contain letters, digits, '.', '_' and '-'".into(),
        ));
    }
    Ok(())
}

/// An account name made from what an identity provider calls someone: the part of an e-mail
/// address before `@`, other characters than letters, digits, `.`, `_` and `-` as `_`, at most
/// 64 characters; `user` when nothing is left.
pub fn account_name_from(claim: &str) -> String {
    let local = claim.split('@').next().unwrap_or(claim);
    let name: String = local
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(MAX_NAME_CHARS)
        .collect();
    if name.trim_matches('_').is_empty() {
        "user".to_string()
    } else {
        name
    }
}

/// Checks a new password's length (8 characters to 1024 bytes).
pub fn check_password(password: &str) -> Result<(), AuthError> {
    if password.chars().count() < MIN_PASSWORD_CHARS {
        return Err(AuthError::BadPassword(format!(
            "a password needs at least {MIN_PASSWORD_CHARS} characters"
        )));
    }
    if password.len() > MAX_PASSWORD_BYTES {
        return Err(AuthError::BadPassword(format!(
            "a password may have at most {MAX_PASSWORD_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The argon2id PHC string of `password` under a fresh random salt. CPU-heavy (tens of
/// milliseconds): async callers use [`hash_password_async`].
pub fn hash_password(password: &str) -> Result<String, AuthError> {
    let salt = SaltString::encode_b64(&rand::random::<[u8; 16]>())
        .map_err(|e| AuthError::Hash(e.to_string()))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| AuthError::Hash(e.to_string()))
}

/// Whether `password` matches the PHC string `hash` (false for a malformed hash).
pub fn verify_password(password: &str, hash: &str) -> bool {
    PasswordHash::new(hash).is_ok_and(|parsed| {
        Argon2::default()
            .verify_password(password.as_bytes(), &parsed)
            .is_ok()
    })
}

/// Bounds the argon2 computations running at once to the number of cores: each takes about
/// 19 MiB and a core for tens of milliseconds, so a flood of sign-ins from many addresses (each
/// within its free failures) queues here instead of filling the blocking pool and the memory.
fn hashing_permits() -> &'static tokio::sync::Semaphore {
    static PERMITS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    PERMITS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tokio::sync::Semaphore::new(cores)
    })
}

/// Runs `work` (an argon2 computation) on a blocking thread under [`hashing_permits`].
async fn hashing<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, AuthError> {
    let _permit = hashing_permits()
        .acquire()
        .await
        .map_err(|e| AuthError::Hash(format!("the hashing gate is closed: {e}")))?;
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| AuthError::Hash(format!("the hashing thread failed: {e}")))
}

/// [`hash_password`] on a blocking thread.
pub async fn hash_password_async(password: String) -> Result<String, AuthError> {
    hashing(move || hash_password(&password)).await?
}

async fn verify_async(password: String, hash: String) -> Result<bool, AuthError> {
    hashing(move || verify_password(&password, &hash)).await
}

/// A fresh invite code and its stored id.
pub fn new_invite_code() -> (String, String) {
    secret::new_session()
}

/// Stores a new invite valid for `ttl` and returns its code (shown once).
pub async fn create_invite(store: &Store, ttl: Duration) -> Result<String, AuthError> {
    let (code, id) = new_invite_code();
    let ttl = chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::MAX);
    store.create_invite(&id, ttl).await?;
    Ok(code)
}

/// Creates an account directly (CLI, the configured first admin): no sign-up policy, no
/// session. [`AuthError::NameTaken`] when the name is in use.
pub async fn add_user(
    store: &Store,
    name: &str,
    password: &str,
    role: UserRole,
) -> Result<User, AuthError> {
    check_name(name)?;
    check_password(password)?;
    let hash = hash_password_async(password.to_string()).await?;
    let id = uuid::Uuid::now_v7().to_string();
    match store
        .create_user(&NewUser {
            id: &id,
            name,
            password_hash: &hash,
            role,
            invite: None,
            adopt_from: None,
        })
        .await?
    {
        CreatedUser::Created { user, .. } => Ok(user),
        CreatedUser::NameTaken => Err(AuthError::NameTaken),
        CreatedUser::InviteInvalid => Err(AuthError::InviteInvalid),
    }
}

/// Sets a new password (CLI and the account page) and revokes every session of the account.
pub async fn set_password(store: &Store, user: &User, password: &str) -> Result<(), AuthError> {
    check_password(password)?;
    let hash = hash_password_async(password.to_string()).await?;
    if !store.set_password(&user.id, &hash).await? {
        return Err(AuthError::NoSuchUser(user.name.clone()));
    }
    Ok(())
}

/// A password reset's outcome: the new password (to be handed to the user once) and how many
/// live API keys were revoked with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswordReset {
    pub password: String,
    pub keys_revoked: u64,
}

/// An administrator's password reset: a new random password, every session ended, every live
/// personal API key revoked (a reset is what one does to an account someone else may hold; a
/// key would outlive it otherwise), and the next sign-in must choose a new password first.
pub async fn reset_password(store: &Store, user: &User) -> Result<PasswordReset, AuthError> {
    // 16 characters from an alphabet without look-alikes (no 0/O, 1/l/I): ~92 bits.
    const ALPHABET: &[u8] = b"abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789";
    let password: String = (0..16)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect();
    let hash = hash_password_async(password.clone()).await?;
    if !store.replace_password(&user.id, &hash, true).await? {
        return Err(AuthError::NoSuchUser(user.name.clone()));
    }
    let keys_revoked = store.revoke_all_api_keys(&user.id).await?;
    Ok(PasswordReset {
        password,
        keys_revoked,
    })
}

/// Creates the configured first admin when no account exists; `true` when it did.
pub async fn ensure_initial_admin(
    store: &Store,
    name: &str,
    password: &str,
) -> Result<bool, AuthError> {
    if store.count_users().await? > 0 {
        return Ok(false);
    }
    match add_user(store, name, password, UserRole::Admin).await {
        Ok(_) => Ok(true),
        // Another process made an account in between: the rule is "only if none exists".
        Err(AuthError::NameTaken) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Sign-ups one client address may make before it must wait (`auth.signups_per_address`), then
/// lockouts from 10 minutes doubling up to a day (counts are forgotten a day after the last).
/// Generous for a household or an office behind one address, a wall for a script.
fn signup_policy(per_address: u32, max_entries: usize) -> ThrottlePolicy {
    ThrottlePolicy {
        free_per_address: per_address.max(1),
        free_per_subject: u32::MAX,
        base_lockout: Duration::from_secs(600),
        max_lockout: Duration::from_secs(24 * 3600),
        max_entries,
    }
}

/// Who may create an account (`auth.signup`): anyone, holders of an invite code, or no one.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SignupMode {
    #[default]
    Open,
    Invite,
    Closed,
}

/// The accounts service's settings.
#[derive(Clone, Debug)]
pub struct AccountsConfig {
    pub signup: SignupMode,
    pub session_lifetime: Duration,
    pub throttle: ThrottlePolicy,
    /// Accounts one address may create before it must wait.
    pub signups_per_address: u32,
    /// Live personal API keys one account may hold.
    pub max_api_keys: usize,
    /// Live sessions one account may hold (a new one ends the oldest beyond it).
    pub max_sessions: usize,
    /// Whether accounts may sign in (and sign up) with a password (`auth.password_login`).
    pub password_login: bool,
    /// OpenID Connect sign-in (`[auth.oidc]`), when configured.
    pub oidc: Option<crate::oidc::OidcConfig>,
}

impl Default for AccountsConfig {
    fn default() -> Self {
        AccountsConfig {
            signup: SignupMode::Open,
            session_lifetime: Duration::from_secs(30 * 24 * 3600),
            throttle: ThrottlePolicy::default(),
            signups_per_address: 10,
            max_api_keys: 50,
            max_sessions: 100,
            password_login: true,
            oidc: None,
        }
    }
}

/// A successful sign-in or sign-up: the account and the session for the cookie.
#[derive(Debug)]
pub struct SignedIn {
    pub user: User,
    pub session: NewSession,
    /// Guest conversations moved into the account (sign-up only).
    pub adopted: u64,
}

/// A new personal API key: the key (shown once) and what is stored about it.
#[derive(Debug)]
pub struct NewApiKey {
    pub key: String,
    pub record: ApiKeyRecord,
}

pub struct Accounts {
    store: Store,
    key: Vec<u8>,
    config: AccountsConfig,
    throttle: Mutex<LoginThrottle>,
    /// Sign-ups per client address (`auth.signups_per_address`).
    signups: Mutex<LoginThrottle>,
    /// Verified against when the name is unknown, so unknown names cost the same time.
    dummy_hash: String,
    oidc: Option<crate::oidc::Oidc>,
}

impl Accounts {
    /// `key` keys the session fingerprints (the cookie key, kept across restarts).
    pub fn new(store: Store, key: &[u8], config: AccountsConfig) -> Result<Accounts, AuthError> {
        let dummy: [u8; 16] = rand::random();
        let dummy_hash = hash_password(&secret::hex(&dummy))?;
        let oidc = match &config.oidc {
            Some(c) => Some(crate::oidc::Oidc::new(c.clone()).map_err(AuthError::Config)?),
            None => None,
        };
        Ok(Accounts {
            oidc,
            store,
            key: key.to_vec(),
            throttle: Mutex::new(LoginThrottle::new(config.throttle.clone())),
            signups: Mutex::new(LoginThrottle::new(signup_policy(
                config.signups_per_address,
                config.throttle.max_entries,
            ))),
            config,
            dummy_hash,
        })
    }

    pub fn signup_mode(&self) -> SignupMode {
        if self.config.password_login {
            self.config.signup
        } else {
            // Sign-up makes a password account; with passwords off, accounts come from the
            // identity provider (or an administrator).
            SignupMode::Closed
        }
    }

    /// Whether the password form is offered and accepted (`auth.password_login`).
    pub fn password_login(&self) -> bool {
        self.config.password_login
    }

    /// OpenID Connect sign-in, when `[auth.oidc]` is configured.
    pub fn oidc(&self) -> Option<&crate::oidc::Oidc> {
        self.oidc.as_ref()
    }

    /// Refused with a pointer to the other way in when passwords are off.
    fn require_password_login(&self) -> Result<(), AuthError> {
        if self.config.password_login {
            return Ok(());
        }
        let other = self
            .oidc
            .as_ref()
            .map(|o| o.config().label.clone())
            .unwrap_or_else(|| "your organisation's sign-in".into());
        Err(AuthError::PasswordLoginOff(other))
    }

    /// The store, for tests that set up or inspect what the service did.
    #[cfg(test)]
    fn store(&self) -> &Store {
        &self.store
    }

    fn throttle(&self) -> std::sync::MutexGuard<'_, LoginThrottle> {
        // Consistent between method calls, none of which panics half-way.
        self.throttle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fingerprint(&self, password_hash: &str) -> String {
        secret::fingerprint(&self.key, FINGERPRINT_PURPOSE, password_hash)
    }

    async fn new_session(&self, user: &User) -> Result<NewSession, AuthError> {
        let (token, id) = secret::new_session();
        let lifetime = chrono::Duration::from_std(self.config.session_lifetime)
            .unwrap_or(chrono::Duration::MAX);
        self.store
            .create_session(
                &id,
                SessionKind::User,
                &user.id,
                &self.fingerprint(&user.password_hash),
                lifetime,
            )
            .await?;
        // Bounded: signing in again and again (or a script doing it) ends the oldest sessions
        // instead of growing the table.
        match self
            .store
            .trim_sessions_of(SessionKind::User, &user.id, self.config.max_sessions.max(1))
            .await
        {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(user = %user.id, ended = n, "oldest sessions ended: the account is at auth.max_sessions_per_user")
            }
            Err(e) => tracing::warn!("cannot bound an account's sessions: {e}"),
        }
        if let Err(e) = self.store.touch_user(&user.id).await {
            tracing::warn!("cannot record an account's last sign-in: {e}");
        }
        Ok(NewSession {
            token,
            lifetime: self.config.session_lifetime,
        })
    }

    /// Creates an account under the sign-up policy (`invite` needs a valid code), moves the
    /// guest `adopt_from`'s conversations into it, and signs it in.
    pub async fn sign_up(
        &self,
        name: &str,
        password: &str,
        invite: Option<&str>,
        adopt_from: Option<&str>,
        client: IpAddr,
    ) -> Result<SignedIn, AuthError> {
        self.require_password_login()?;
        let invite_id = match self.config.signup {
            SignupMode::Closed => return Err(AuthError::SignupClosed),
            SignupMode::Open => None,
            SignupMode::Invite => {
                let code = invite.map(str::trim).filter(|c| !c.is_empty());
                let Some(code) = code else {
                    return Err(AuthError::InviteInvalid);
                };
                // A malformed code cannot be one of ours.
                Some(secret::session_id(code).ok_or(AuthError::InviteInvalid)?)
            }
        };
        check_name(name)?;
        check_password(password)?;
        // Counted before the (costly) hash and never taken back: accounts are owners, and one
        // address must not make them without bound.
        self.signups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .attempt(&[ThrottleKey::address(client)], Instant::now())
            .map_err(AuthError::TooManySignups)?;
        let hash = hash_password_async(password.to_string()).await?;
        let id = uuid::Uuid::now_v7().to_string();
        let created = self
            .store
            .create_user(&NewUser {
                id: &id,
                name,
                password_hash: &hash,
                role: UserRole::User,
                invite: invite_id.as_deref(),
                adopt_from,
            })
            .await?;
        let (user, adopted) = match created {
            CreatedUser::Created { user, adopted } => (user, adopted),
            CreatedUser::NameTaken => return Err(AuthError::NameTaken),
            CreatedUser::InviteInvalid => return Err(AuthError::InviteInvalid),
        };
        tracing::info!(user = %user.id, adopted, "account created");
        let session = self.new_session(&user).await?;
        Ok(SignedIn {
            user,
            session,
            adopted,
        })
    }

    /// Failed sign-ins one key may have per UTC minute on all replicas together: twice the
    /// free failures of one replica's throttle, about what its doubling lockouts let through
    /// in a minute, so N replicas give a guesser one replica's pace rather than N times it.
    fn shared_failure_cap(&self, key: &ThrottleKey) -> i64 {
        let free = match key {
            ThrottleKey::Address(_) => self.config.throttle.free_per_address,
            ThrottleKey::Subject(_) => self.config.throttle.free_per_subject,
        };
        i64::from(free.max(1)) * 2
    }

    /// Refused when a key's failures this minute, counted in the store by every replica, reach
    /// [`Accounts::shared_failure_cap`]. A store that cannot answer does not refuse (logged):
    /// the in-memory throttle still holds.
    async fn shared_lockout(&self, keys: &[ThrottleKey]) -> Result<(), AuthError> {
        let now = chrono::Utc::now();
        for key in keys {
            let failures = match self
                .store
                .usage(&key.counter_name(), smolchat_store::Period::Minute, now)
                .await
            {
                Ok(u) => u.events,
                Err(e) => {
                    tracing::warn!("cannot read the shared sign-in failures: {e}");
                    continue;
                }
            };
            if failures >= self.shared_failure_cap(key) {
                let left = smolchat_store::Period::Minute.end(now) - now;
                return Err(AuthError::Throttled(crate::throttle::Lockout {
                    by: match key {
                        ThrottleKey::Address(_) => crate::LockedBy::Address,
                        ThrottleKey::Subject(_) => crate::LockedBy::Subject,
                    },
                    retry_after: left.to_std().unwrap_or(Duration::from_secs(1)),
                }));
            }
        }
        Ok(())
    }

    /// Counts a failed sign-in against each key, in the store every replica reads.
    async fn count_shared_failure(&self, keys: &[ThrottleKey]) {
        let now = chrono::Utc::now();
        for key in keys {
            if let Err(e) = self.store.count_event(&key.counter_name(), now).await {
                tracing::warn!("cannot count a failed sign-in for the other replicas: {e}");
            }
        }
    }

    /// Signs in: refused while the address or the name is locked (before any password is
    /// looked at); a wrong name or password is [`AuthError::WrongCredentials`] either way, and so
    /// is a disabled account, right password or not (the answer must not confirm a password),
    /// counted as a failure like any other.
    pub async fn sign_in(
        &self,
        name: &str,
        password: &str,
        client: IpAddr,
    ) -> Result<SignedIn, AuthError> {
        self.require_password_login()?;
        let keys = [
            ThrottleKey::address(client),
            // Case-folded like the unique index, so "Alice" and "alice" share one counter.
            ThrottleKey::subject(format!("user:{}", name.to_ascii_lowercase())),
        ];
        self.throttle()
            .attempt(&keys, Instant::now())
            .map_err(AuthError::Throttled)?;
        self.shared_lockout(&keys).await?;
        if password.len() > MAX_PASSWORD_BYTES {
            self.count_shared_failure(&keys).await;
            return Err(AuthError::WrongCredentials);
        }
        let user = if check_name(name).is_ok() {
            self.store.user_by_name(name).await?
        } else {
            None
        };
        let hash = user
            .as_ref()
            .map_or_else(|| self.dummy_hash.clone(), |u| u.password_hash.clone());
        let right = verify_async(password.to_string(), hash).await?;
        let Some(user) = user.filter(|u| right && !u.is_disabled()) else {
            self.count_shared_failure(&keys).await;
            return Err(AuthError::WrongCredentials);
        };
        self.throttle().success(&keys, Instant::now());
        let session = self.new_session(&user).await?;
        Ok(SignedIn {
            user,
            session,
            adopted: 0,
        })
    }

    /// The account a session cookie's `token` stands for, if the session is valid now: not
    /// revoked or expired, the account not disabled, and made under its current password.
    /// The account a trusted authenticating proxy vouches for (`auth.trusted_user_header`),
    /// by the rule OpenID Connect sign-in has: the header's value is an identity (issuer
    /// [`TRUSTED_HEADER_ISSUER`], subject the value exactly as sent), linked to one account. On
    /// first sight an account is made for it, named after the value the way
    /// [`account_name_from`] says (`alice@example.com` → `alice`; other characters than letters,
    /// digits, `.`, `_` and `-` as `_`; at most 64 characters) and `-2`, `-3`… when that name is
    /// taken: an existing account is never taken over by name. With `adopt_by_name`
    /// (`auth.trusted_header_adopt_names`, for servers whose header-made accounts predate the
    /// links) a value equal to an existing account's name, of an account no identity is linked
    /// to yet, is linked to that account once instead.
    ///
    /// `admin` (from the proxy's groups header, when configured) sets the role on every
    /// request, so a change of groups at the identity provider takes effect at once. A disabled
    /// account stays disabled ([`AuthError::Disabled`]). Besides the account, says what changed,
    /// for the audit log: `Some("account made")`, `Some("linked by name")`, `Some("role changed
    /// to admin")` / `Some("role changed to user")`, or `None`.
    pub async fn external_user(
        &self,
        value: &str,
        admin: Option<bool>,
        adopt_by_name: bool,
    ) -> Result<(User, Option<&'static str>), AuthError> {
        let value = value.trim();
        if value.is_empty() || value.chars().count() > MAX_TRUSTED_VALUE_CHARS {
            return Err(AuthError::BadName(format!(
                "the proxy's user header must hold 1 to {MAX_TRUSTED_VALUE_CHARS} characters"
            )));
        }
        let role = |admin: bool| {
            if admin {
                UserRole::Admin
            } else {
                UserRole::User
            }
        };
        let found = self
            .store
            .user_by_identity(TRUSTED_HEADER_ISSUER, value)
            .await?;
        let adopted = match (&found, adopt_by_name) {
            (None, true) => self.adopt_by_name(value).await?,
            _ => None,
        };
        let (user, changed) = match (found, adopted) {
            (Some(user), _) => (user, None),
            (None, Some(user)) => (user, Some("linked by name")),
            (None, None) => {
                let who = crate::oidc::Verified {
                    issuer: TRUSTED_HEADER_ISSUER.to_string(),
                    subject: value.to_string(),
                    name: value.to_string(),
                    email: None,
                    groups: Vec::new(),
                    admin,
                };
                let (user, made) = self
                    .make_linked_user(&who, role(admin.unwrap_or(false)))
                    .await?;
                (user, made.then_some("account made"))
            }
        };
        if user.disabled_at.is_some() {
            return Err(AuthError::Disabled);
        }
        match admin {
            Some(admin) if user.is_admin() != admin => {
                self.store.set_user_role(&user.id, role(admin)).await?;
                let role_change = if admin {
                    "role changed to admin"
                } else {
                    "role changed to user"
                };
                Ok((
                    self.store.user_by_id(&user.id).await?.unwrap_or(user),
                    changed.or(Some(role_change)),
                ))
            }
            _ => Ok((user, changed)),
        }
    }

    /// The account named exactly `value`, linked to the trusted header's identity `value`, when
    /// no identity is linked to it yet (see [`Accounts::external_user`]).
    async fn adopt_by_name(&self, value: &str) -> Result<Option<User>, AuthError> {
        let Some(user) = self.store.user_by_name(value).await? else {
            return Ok(None);
        };
        if user.name != value || self.store.has_identities(&user.id).await? {
            return Ok(None);
        }
        if self
            .store
            .link_identity(&user.id, TRUSTED_HEADER_ISSUER, value)
            .await?
        {
            tracing::info!(user = %user.id, "an existing account linked to the trusted proxy's user of the same name");
            Ok(Some(user))
        } else {
            // Linked beside this request: whoever won is the account.
            Ok(self
                .store
                .user_by_identity(TRUSTED_HEADER_ISSUER, value)
                .await?)
        }
    }

    /// Signs in the person an OpenID Connect provider vouched for (checked by
    /// [`crate::oidc::Oidc::finish`]): the account linked to their `(issuer, subject)`, or on the
    /// first sign-in a new one named after the claim (made valid, and `-2`, `-3`… when the name
    /// is taken: an existing local account is never taken over by name). The role follows the
    /// admin group on every sign-in when `auth.oidc.admin_group` is set. `created` says whether
    /// the account is new.
    pub async fn oidc_sign_in(
        &self,
        who: &crate::oidc::Verified,
    ) -> Result<(SignedIn, bool), AuthError> {
        let role = |admin: bool| {
            if admin {
                UserRole::Admin
            } else {
                UserRole::User
            }
        };
        let (mut user, created) = match self
            .store
            .user_by_identity(&who.issuer, &who.subject)
            .await?
        {
            Some(user) => (user, false),
            None => {
                self.make_linked_user(who, role(who.admin.unwrap_or(false)))
                    .await?
            }
        };
        if user.is_disabled() {
            return Err(AuthError::Disabled);
        }
        if let Some(admin) = who.admin {
            if user.is_admin() != admin {
                self.store.set_user_role(&user.id, role(admin)).await?;
                user.role = role(admin);
            }
        }
        let session = self.new_session(&user).await?;
        Ok((
            SignedIn {
                user,
                session,
                adopted: 0,
            },
            created,
        ))
    }

    /// A new account linked to `who`'s identity, under the first free name made from theirs;
    /// `false` beside it when a request beside this one linked the identity first (its
    /// account is returned).
    async fn make_linked_user(
        &self,
        who: &crate::oidc::Verified,
        role: UserRole,
    ) -> Result<(User, bool), AuthError> {
        let base = account_name_from(&who.name);
        // Nobody knows this password: only the provider signs the account in.
        let secret: [u8; 32] = rand::random();
        let hash = hash_password_async(secret::hex(&secret)).await?;
        for n in 1..=50u32 {
            let name = if n == 1 {
                base.clone()
            } else {
                let suffix = format!("-{n}");
                let keep = MAX_NAME_CHARS.saturating_sub(suffix.len());
                format!("{}{suffix}", base.chars().take(keep).collect::<String>())
            };
            let id = uuid::Uuid::now_v7().to_string();
            match self
                .store
                .create_user(&NewUser {
                    id: &id,
                    name: &name,
                    password_hash: &hash,
                    role,
                    invite: None,
                    adopt_from: None,
                })
                .await?
            {
                CreatedUser::Created { user, .. } => {
                    if self
                        .store
                        .link_identity(&user.id, &who.issuer, &who.subject)
                        .await?
                    {
                        tracing::info!(user = %user.id, name, issuer = %who.issuer, "account made for an identity");
                        return Ok((user, true));
                    }
                    // A sign-in beside this one linked the identity first: use theirs.
                    self.store.delete_user(&user.id).await?;
                    return self
                        .store
                        .user_by_identity(&who.issuer, &who.subject)
                        .await?
                        .map(|u| (u, false))
                        .ok_or(AuthError::WrongCredentials);
                }
                CreatedUser::NameTaken => continue,
                CreatedUser::InviteInvalid => return Err(AuthError::InviteInvalid),
            }
        }
        Err(AuthError::BadName(format!(
            "no free account name near {base:?} (50 tried)"
        )))
    }

    pub async fn session(&self, token: &str) -> Result<Option<User>, AuthError> {
        let Some(id) = secret::session_id(token) else {
            return Ok(None);
        };
        let Some((session, user)) = self.store.user_session(&id).await? else {
            return Ok(None);
        };
        let expected = self.fingerprint(&user.password_hash);
        if !bool::from(expected.as_bytes().ct_eq(session.fingerprint.as_bytes())) {
            return Ok(None);
        }
        // Coarse, and skipped without a statement when recent: every page request comes here,
        // and even an UPDATE that matches nothing takes SQLite's write lock.
        let stale = user
            .last_seen_at
            .is_none_or(|t| chrono::Utc::now() - t > chrono::Duration::seconds(60));
        if stale {
            if let Err(e) = self.store.touch_user(&user.id).await {
                tracing::warn!("cannot record an account's last use: {e}");
            }
        }
        Ok(Some(user))
    }

    /// Revokes the session `token` stands for (every copy of the cookie stops working).
    pub async fn sign_out(&self, token: &str) -> Result<bool, AuthError> {
        let Some(id) = secret::session_id(token) else {
            return Ok(false);
        };
        Ok(self.store.revoke_session(&id).await?)
    }

    /// Revokes every session of `user` ("sign out everywhere", the admin's "revoke sessions").
    pub async fn revoke_sessions(&self, user_id: &str) -> Result<u64, AuthError> {
        Ok(self
            .store
            .revoke_sessions_of(SessionKind::User, user_id)
            .await?)
    }

    /// Disables or enables the account `user_id` (disabling revokes its sessions in the same
    /// transaction); whether the account exists.
    pub async fn set_disabled(&self, user_id: &str, disabled: bool) -> Result<bool, AuthError> {
        Ok(self.store.set_disabled(user_id, disabled).await?)
    }

    /// Signs the account `user_id` out everywhere; whether the account exists.
    pub async fn revoke_all_sessions(&self, user_id: &str) -> Result<bool, AuthError> {
        self.revoke_sessions(user_id).await?;
        Ok(self.store.user_by_id(user_id).await?.is_some())
    }

    /// The account `user_id`, disabled or not.
    pub async fn user(&self, user_id: &str) -> Result<Option<User>, AuthError> {
        Ok(self.store.user_by_id(user_id).await?)
    }

    /// `user`'s API keys, newest first (revoked ones included, marked).
    pub async fn api_keys(&self, user: &User) -> Result<Vec<ApiKeyRecord>, AuthError> {
        Ok(self.store.list_api_keys(&user.id).await?)
    }

    /// Revokes `user`'s live key `key_id`; whether there was one.
    pub async fn revoke_api_key(&self, user: &User, key_id: &str) -> Result<bool, AuthError> {
        Ok(self.store.revoke_api_key(&user.id, key_id).await?)
    }

    /// Changes `user`'s password after checking the current one (throttled like a sign-in),
    /// revokes every session of the account, and returns a fresh one for the caller's browser.
    pub async fn change_password(
        &self,
        user: &User,
        current: &str,
        new: &str,
        client: IpAddr,
    ) -> Result<NewSession, AuthError> {
        let keys = [
            ThrottleKey::address(client),
            ThrottleKey::subject(format!("user:{}", user.name.to_ascii_lowercase())),
        ];
        self.throttle()
            .attempt(&keys, Instant::now())
            .map_err(AuthError::Throttled)?;
        if current.len() > MAX_PASSWORD_BYTES
            || !verify_async(current.to_string(), user.password_hash.clone()).await?
        {
            return Err(AuthError::WrongCredentials);
        }
        self.throttle().success(&keys, Instant::now());
        check_password(new)?;
        set_password(&self.store, user, new).await?;
        let Some(updated) = self.store.user_by_id(&user.id).await? else {
            return Err(AuthError::NoSuchUser(user.name.clone()));
        };
        tracing::info!(user = %user.id, "password changed; every session revoked");
        self.new_session(&updated).await
    }

    /// Makes a personal API key for `user` (the key is returned once; only its hash is kept).
    pub async fn create_api_key(&self, user: &User, name: &str) -> Result<NewApiKey, AuthError> {
        let name = name.trim();
        check_key_name(name)?;
        let live = self.store.count_live_api_keys(&user.id).await?;
        if live >= self.config.max_api_keys as u64 {
            return Err(AuthError::TooManyKeys(self.config.max_api_keys));
        }
        let (token, id) = secret::new_session();
        let key = format!("{API_KEY_PREFIX}{token}");
        let stored_id = api_key_id(&key).ok_or_else(|| AuthError::Hash("bad key".into()))?;
        debug_assert_eq!(stored_id, id);
        let prefix: String = key.chars().take(DISPLAY_PREFIX_CHARS).collect();
        let record = self
            .store
            .create_api_key(&stored_id, &user.id, name, &prefix)
            .await?;
        Ok(NewApiKey { key, record })
    }

    /// The account a `/v1` bearer key belongs to. `Ok(None)` when `key` is not shaped like a
    /// personal key; [`AuthError::KeyRefused`] when it is, but unknown, revoked, or its account
    /// is disabled.
    pub async fn api_key_user(&self, key: &str) -> Result<Option<User>, AuthError> {
        let Some(id) = api_key_id(key) else {
            return Ok(None);
        };
        match self.store.api_key_user(&id).await? {
            Some(user) => Ok(Some(user)),
            None => Err(AuthError::KeyRefused),
        }
    }
}

/// The rules for a key's name: at most 64 characters, none of them a control character (NUL
/// included: PostgreSQL cannot store it, and no name needs one).
pub fn check_key_name(name: &str) -> Result<(), AuthError> {
    if name.chars().count() > 64 {
        return Err(AuthError::BadName(
            "a key's name has at most 64 characters".into(),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(AuthError::BadName(format!(
            "a key's name cannot hold control characters (found U+{:04X})",
            c as u32
        )));
    }
    Ok(())
}

/// The stored id (SHA-256 of the hex part) of a personal API key, `None` when `key` is not
/// shaped like one.
pub fn api_key_id(key: &str) -> Option<String> {
    key.strip_prefix(API_KEY_PREFIX)
        .and_then(secret::session_id)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::LockedBy;
    use smolchat_store::ConversationSettings;

    const HOME: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    async fn accounts(signup: SignupMode) -> Accounts {
        let store = Store::open("sqlite::memory:").await.unwrap();
        Accounts::new(
            store,
            b"key",
            AccountsConfig {
                signup,
                session_lifetime: Duration::from_secs(3600),
                throttle: ThrottlePolicy {
                    free_per_address: 3,
                    free_per_subject: 100,
                    base_lockout: Duration::from_secs(600),
                    ..ThrottlePolicy::default()
                },
                ..AccountsConfig::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn names_and_passwords_are_checked() {
        assert!(check_name("alice.b-c_9").is_ok());
        for bad in ["", "a b", "é", "a/b", &"a".repeat(65)] {
            assert!(
                matches!(check_name(bad), Err(AuthError::BadName(_))),
                "{bad}"
            );
        }
        assert!(check_password("12345678").is_ok());
        assert!(check_password("1234567").is_err());
        assert!(check_password(&"x".repeat(1025)).is_err());
        assert!(check_password(&"x".repeat(1024)).is_ok());
    }

    #[test]
    fn hashes_are_argon2id_salted_and_verify() {
        let a = hash_password("correct horse").unwrap();
        let b = hash_password("correct horse").unwrap();
        assert!(a.starts_with("$argon2id$"), "{a}");
        assert_ne!(a, b, "salted");
        assert!(verify_password("correct horse", &a));
        assert!(!verify_password("correct horsE", &a));
        assert!(!verify_password("correct horse", "not a hash"));
    }

    #[tokio::test]
    async fn failed_sign_ins_count_across_replicas_sharing_a_store() {
        // Three replicas: three services (each with its own in-memory throttle) on one store.
        let store = Store::open("sqlite::memory:").await.unwrap();
        let config = AccountsConfig {
            throttle: ThrottlePolicy {
                free_per_address: 100,
                free_per_subject: 3,
                base_lockout: Duration::from_secs(600),
                ..ThrottlePolicy::default()
            },
            ..AccountsConfig::default()
        };
        let a = Accounts::new(store.clone(), b"key", config.clone()).unwrap();
        let b = Accounts::new(store.clone(), b"key", config.clone()).unwrap();
        let c = Accounts::new(store.clone(), b"key", config).unwrap();
        add_user(&store, "carol", "carol's password", UserRole::User)
            .await
            .unwrap();
        let ip = |n| IpAddr::V4(Ipv4Addr::new(10, 0, 0, n));
        // In turn, each replica sees only two failures: under its own limit of three free ones,
        // but six in all, the shared cap (twice the free failures).
        let minute_start = chrono::Utc::now().timestamp() % 60;
        if minute_start > 50 {
            tokio::time::sleep(Duration::from_secs(61 - minute_start as u64)).await;
        }
        for n in 0..6u8 {
            let replica = [&a, &b, &c][usize::from(n % 3)];
            let e = replica.sign_in("carol", "wrong", ip(n)).await.unwrap_err();
            assert!(matches!(e, AuthError::WrongCredentials), "{n}: {e}");
        }
        for replica in [&a, &b, &c] {
            let e = replica
                .sign_in("carol", "carol's password", ip(99))
                .await
                .unwrap_err();
            let AuthError::Throttled(lockout) = e else {
                panic!("not throttled: {e}");
            };
            assert_eq!(lockout.by, LockedBy::Subject);
            assert!(lockout.retry_after_s() <= 60);
        }
    }

    #[tokio::test]
    async fn sign_up_in_out_and_password_change() {
        let acc = accounts(SignupMode::Open).await;
        let settings = ConversationSettings::default();
        acc.store()
            .create_conversation("guest-x", &settings)
            .await
            .unwrap();
        let up = acc
            .sign_up("alice", "password one", None, Some("guest-x"), HOME)
            .await
            .unwrap();
        assert_eq!(up.adopted, 1);
        assert_eq!(
            acc.session(&up.session.token).await.unwrap().unwrap().id,
            up.user.id
        );
        assert!(matches!(
            acc.sign_up("ALICE", "password two", None, None, HOME).await,
            Err(AuthError::NameTaken)
        ));
        let other = acc.sign_in("Alice", "password one", HOME).await.unwrap();
        assert_ne!(other.session.token, up.session.token);
        assert!(matches!(
            acc.sign_in("alice", "password two", HOME).await,
            Err(AuthError::WrongCredentials)
        ));
        // Sign-out ends that session only.
        assert!(acc.sign_out(&up.session.token).await.unwrap());
        assert!(acc.session(&up.session.token).await.unwrap().is_none());
        assert!(acc.session(&other.session.token).await.unwrap().is_some());
        // A password change ends every other session and hands out a new one.
        let fresh = acc
            .change_password(&other.user, "password one", "password three", HOME)
            .await
            .unwrap();
        assert!(acc.session(&other.session.token).await.unwrap().is_none());
        assert!(acc.session(&fresh.token).await.unwrap().is_some());
        assert!(acc.sign_in("alice", "password three", HOME).await.is_ok());
    }

    #[tokio::test]
    async fn a_changed_hash_alone_ends_old_sessions() {
        let acc = accounts(SignupMode::Open).await;
        let up = acc
            .sign_up("bob", "password one", None, None, HOME)
            .await
            .unwrap();
        let old_fp = acc.fingerprint(&up.user.password_hash);
        set_password(acc.store(), &up.user, "another one")
            .await
            .unwrap();
        // A live (unrevoked) session made under the old password: refused by its fingerprint.
        let store = acc.store().clone();
        let user_id = up.user.id.clone();
        let live = |fp: String| {
            let (store, user_id) = (store.clone(), user_id.clone());
            async move {
                let (token, id) = secret::new_session();
                store
                    .create_session(
                        &id,
                        SessionKind::User,
                        &user_id,
                        &fp,
                        chrono::Duration::hours(1),
                    )
                    .await
                    .unwrap();
                token
            }
        };
        let old = live(old_fp).await;
        assert!(acc.session(&old).await.unwrap().is_none());
        let now = acc.store().user_by_id(&up.user.id).await.unwrap().unwrap();
        let new = live(acc.fingerprint(&now.password_hash)).await;
        assert!(acc.session(&new).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn wrong_passwords_lock_the_address_even_for_unknown_names() {
        let acc = accounts(SignupMode::Open).await;
        acc.sign_up("carol", "password one", None, None, HOME)
            .await
            .unwrap();
        for (name, pw) in [("carol", "nope nope"), ("nobody", "x"), ("bad name!", "y")] {
            assert!(matches!(
                acc.sign_in(name, pw, HOME).await,
                Err(AuthError::WrongCredentials)
            ));
        }
        match acc.sign_in("carol", "password one", HOME).await {
            Err(AuthError::Throttled(l)) => {
                assert_eq!(l.by, LockedBy::Address);
                assert!(l.retry_after_s() > 590);
            }
            other => panic!("expected a lockout, got {other:?}"),
        }
        let elsewhere = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        assert!(acc
            .sign_in("carol", "password one", elsewhere)
            .await
            .is_ok());
    }

    #[tokio::test]
    async fn disabled_accounts_lose_sessions_and_keys() {
        let acc = accounts(SignupMode::Open).await;
        let up = acc
            .sign_up("dave", "password one", None, None, HOME)
            .await
            .unwrap();
        let key = acc.create_api_key(&up.user, "laptop").await.unwrap();
        assert!(key.key.starts_with(API_KEY_PREFIX));
        assert!(key.record.prefix.len() < key.key.len());
        assert_ne!(key.record.id, key.key, "only the hash is stored");
        assert_eq!(
            acc.api_key_user(&key.key).await.unwrap().unwrap().id,
            up.user.id
        );
        assert!(acc.api_key_user("some-global-key").await.unwrap().is_none());
        acc.store().set_disabled(&up.user.id, true).await.unwrap();
        assert!(acc.session(&up.session.token).await.unwrap().is_none());
        assert!(matches!(
            acc.api_key_user(&key.key).await,
            Err(AuthError::KeyRefused)
        ));
        // The right password of a disabled account gets the answer a wrong one gets.
        assert!(matches!(
            acc.sign_in("dave", "password one", HOME).await,
            Err(AuthError::WrongCredentials)
        ));
        acc.store().set_disabled(&up.user.id, false).await.unwrap();
        assert!(acc.api_key_user(&key.key).await.unwrap().is_some());
        assert!(acc
            .store()
            .revoke_api_key(&up.user.id, &key.record.id)
            .await
            .unwrap());
        assert!(matches!(
            acc.api_key_user(&key.key).await,
            Err(AuthError::KeyRefused)
        ));
    }

    #[tokio::test]
    async fn key_names_keys_and_sessions_are_bounded() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        let acc = Accounts::new(
            store,
            b"key",
            AccountsConfig {
                max_api_keys: 2,
                max_sessions: 3,
                ..AccountsConfig::default()
            },
        )
        .unwrap();
        let up = acc
            .sign_up("gina", "password one", None, None, HOME)
            .await
            .unwrap();
        for bad in ["a\0b", "tab\there", &"x".repeat(65)] {
            assert!(
                matches!(
                    acc.create_api_key(&up.user, bad).await,
                    Err(AuthError::BadName(_))
                ),
                "{bad:?}"
            );
        }
        let first = acc.create_api_key(&up.user, "one").await.unwrap();
        acc.create_api_key(&up.user, "two").await.unwrap();
        assert!(matches!(
            acc.create_api_key(&up.user, "three").await,
            Err(AuthError::TooManyKeys(2))
        ));
        acc.store()
            .revoke_api_key(&up.user.id, &first.record.id)
            .await
            .unwrap();
        acc.create_api_key(&up.user, "three").await.unwrap();
        // Sessions: the sign-up's plus four sign-ins; only the newest three stay valid.
        let mut tokens = vec![up.session.token.clone()];
        for _ in 0..4 {
            let s = acc.sign_in("gina", "password one", HOME).await.unwrap();
            tokens.push(s.session.token);
        }
        let mut valid = Vec::new();
        for t in &tokens {
            valid.push(acc.session(t).await.unwrap().is_some());
        }
        assert_eq!(valid, [false, false, true, true, true]);
    }

    #[tokio::test]
    async fn invite_and_closed_signup() {
        let closed = accounts(SignupMode::Closed).await;
        assert!(matches!(
            closed
                .sign_up("erin", "password one", None, None, HOME)
                .await,
            Err(AuthError::SignupClosed)
        ));
        let inv = accounts(SignupMode::Invite).await;
        assert!(matches!(
            inv.sign_up("erin", "password one", None, None, HOME).await,
            Err(AuthError::InviteInvalid)
        ));
        assert!(matches!(
            inv.sign_up("erin", "password one", Some("junk"), None, HOME)
                .await,
            Err(AuthError::InviteInvalid)
        ));
        let code = create_invite(inv.store(), Duration::from_secs(60))
            .await
            .unwrap();
        inv.sign_up("erin", "password one", Some(&code), None, HOME)
            .await
            .unwrap();
        assert!(matches!(
            inv.sign_up("frank", "password one", Some(&code), None, HOME)
                .await,
            Err(AuthError::InviteInvalid)
        ));
    }

    #[tokio::test]
    async fn one_address_makes_a_bounded_number_of_accounts() {
        let acc = accounts(SignupMode::Open).await;
        for n in 0..AccountsConfig::default().signups_per_address {
            acc.sign_up(&format!("user{n}"), "password one", None, None, HOME)
                .await
                .unwrap();
        }
        match acc
            .sign_up("one-more", "password one", None, None, HOME)
            .await
        {
            Err(AuthError::TooManySignups(l)) => assert!(l.retry_after_s() > 500),
            other => panic!("expected a lockout, got {other:?}"),
        }
        let elsewhere = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 9));
        acc.sign_up("one-more", "password one", None, None, elsewhere)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn the_initial_admin_is_made_only_into_an_empty_store() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        assert!(ensure_initial_admin(&store, "root", "password one")
            .await
            .unwrap());
        assert!(store
            .user_by_name("root")
            .await
            .unwrap()
            .unwrap()
            .is_admin());
        assert!(!ensure_initial_admin(&store, "root2", "password one")
            .await
            .unwrap());
        assert!(store.user_by_name("root2").await.unwrap().is_none());
    }
}
