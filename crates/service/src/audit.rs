//! The audit log: what is recorded, under which names, and reading it back for the admin page.
//! Recording never fails the action it records (a storage fault is logged instead): the action
//! happened, and refusing it afterwards would be worse than a missing line.
//!
//! Actions (`action` column): `auth.sign_in`, `auth.sign_in_failed`, `auth.sign_up`,
//! `auth.sign_out`, `auth.admin_sign_in`, `auth.admin_sign_in_failed`, `auth.password_changed`,
//! `auth.key_created`, `auth.key_revoked`, `admin.disable_user`, `admin.enable_user`, `admin.revoke_sessions`, `admin.stop`,
//! `admin.evict`, `admin.delete_conversation`, `conversation.delete`, `conversation.import`,
//! `conversation.export`, `tool.call` (a reply called a tool: the conversation's owner is the
//! actor, the detail names the tool and how the call ended), `tool.allow`, `tool.deny`.
//!
//! Every field is bounded ([`bounded`]) and a throttled sign-in is recorded once per address a
//! minute, so no client can grow the log faster than one short row per request it is allowed.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smolchat_serving::window::SlidingWindow;
use smolchat_store::{AuditEntry, AuditFilter, NewAuditEntry, Store, StoreError};

use crate::caller::Caller;

/// The most entries one page of the log holds.
pub const MAX_AUDIT_PAGE: usize = 500;

/// The longest actor and target (`user:` and an account name of at most 64 characters, with
/// room to spare), action and address a row keeps, in characters.
pub const MAX_NAME_FIELD_CHARS: usize = 80;
/// The longest detail a row keeps, in characters.
pub const MAX_DETAIL_CHARS: usize = 300;

/// A throttled sign-in is recorded once per address in this long; the repeats, refused anyway,
/// would only fill the log.
pub const THROTTLED_RECORD_WINDOW: Duration = Duration::from_secs(60);
/// Addresses remembered for that.
const THROTTLED_REMEMBERED: usize = 10_000;

/// Records and reads the audit log. Clones share what they remember (throttled addresses).
#[derive(Clone)]
pub struct Audit {
    store: Store,
    /// Throttled sign-ins recorded per address in the last [`THROTTLED_RECORD_WINDOW`].
    throttled: Arc<Mutex<SlidingWindow<Option<IpAddr>>>>,
}

/// `text` cut to at most `max` characters, the cut marked with an ellipsis.
pub fn bounded(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Who did it, as the log names them.
pub fn actor_of(caller: &Caller) -> String {
    if caller.guest {
        format!("guest:{}", caller.owner)
    } else if caller.owner == "admin" || caller.owner.is_empty() {
        "admin".to_string()
    } else {
        format!("user:{}", caller.owner)
    }
}

fn address_text(address: Option<IpAddr>) -> String {
    address.map(|a| a.to_string()).unwrap_or_default()
}

impl Audit {
    pub fn new(store: Store) -> Self {
        Self {
            store,
            throttled: Arc::new(Mutex::new(SlidingWindow::new(
                THROTTLED_RECORD_WINDOW,
                Duration::ZERO,
                THROTTLED_REMEMBERED,
            ))),
        }
    }

    /// Adds an entry, every field cut to its bound ([`MAX_NAME_FIELD_CHARS`],
    /// [`MAX_DETAIL_CHARS`]): what a client sends (a name tried at sign-in) cannot grow the
    /// log by more than a row's worth. A failure is logged, never returned.
    pub async fn record(
        &self,
        actor: &str,
        action: &str,
        target: &str,
        address: Option<IpAddr>,
        detail: &str,
    ) {
        let entry = NewAuditEntry {
            actor: bounded(actor, MAX_NAME_FIELD_CHARS),
            action: bounded(action, MAX_NAME_FIELD_CHARS),
            target: bounded(target, MAX_NAME_FIELD_CHARS),
            address: address_text(address),
            detail: bounded(detail, MAX_DETAIL_CHARS),
        };
        if let Err(e) = self.store.record_audit(&entry).await {
            tracing::warn!(
                action,
                target,
                "the audit log could not record an action: {e}"
            );
        }
    }

    /// Adds an entry for what conversation owner `owner` did through the model (an account is
    /// named by its name, anyone else as a guest).
    pub async fn record_owner(&self, owner: &str, action: &str, target: &str, detail: &str) {
        let actor = match self.store.user_by_id(owner).await {
            Ok(Some(user)) => format!("user:{}", user.name),
            _ => format!("guest:{owner}"),
        };
        self.record(&actor, action, target, None, detail).await
    }

    /// Adds an entry for what `caller` did (an account is named by its name).
    pub async fn record_by(&self, caller: &Caller, action: &str, target: &str, detail: &str) {
        let mut actor = actor_of(caller);
        if actor.starts_with("user:") {
            if let Ok(Some(user)) = self.store.user_by_id(&caller.owner).await {
                actor = format!("user:{}", user.name);
            }
        }
        self.record(&actor, action, target, caller.address, detail)
            .await
    }

    /// A page of entries matching `filter`, newest first (who may read it is the admin
    /// service's rule: [`crate::admin::Admin::audit`]).
    pub async fn entries(
        &self,
        filter: &AuditFilter,
        limit: usize,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        self.store
            .audit_page(filter, limit.clamp(1, MAX_AUDIT_PAGE))
            .await
    }

    /// Removes entries older than `keep_days` (0: keeps everything); how many.
    pub async fn purge(&self, keep_days: u64) -> u64 {
        if keep_days == 0 {
            return 0;
        }
        match self.store.purge_audit(keep_days).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("purging the audit log failed: {e}");
                0
            }
        }
    }
}

/// What happened at sign-in and on the account page (recorded by [`Audit::auth`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthEvent {
    SignIn,
    /// Refused: `why` is `wrong`, `throttled` or `disabled` (never the password).
    SignInFailed {
        why: &'static str,
    },
    SignUp,
    /// Signed in through the identity provider (`how`: `oidc`, or `oidc, account made`).
    ExternalSignIn {
        how: String,
    },
    SignOut,
    /// Signed in to the admin page with `server.admin_token`.
    AdminTokenSignIn,
    /// A refused admin-token sign-in: `why` is `wrong` or `throttled` (never the token).
    AdminTokenSignInFailed {
        why: &'static str,
    },
    PasswordChanged,
    KeyCreated {
        prefix: String,
    },
    KeyRevoked {
        id: String,
    },
}

impl Audit {
    /// Whether a throttled sign-in from `address` goes in the log now: once per
    /// [`THROTTLED_RECORD_WINDOW`] per address.
    fn first_throttled_in_window(&self, address: Option<IpAddr>) -> bool {
        match self.throttled.lock() {
            Ok(mut seen) => seen.take(&[address], 1, 1, Instant::now()).is_ok(),
            Err(_) => true,
        }
    }

    /// Records an account event of `name` (the account's name; for a failed sign-in, the name
    /// that was tried, cut to an account name's length) from `address`. A throttled attempt is
    /// recorded once per address per [`THROTTLED_RECORD_WINDOW`].
    pub async fn auth(&self, event: AuthEvent, name: &str, address: Option<IpAddr>) {
        let throttled = matches!(
            event,
            AuthEvent::SignInFailed { why: "throttled" }
                | AuthEvent::AdminTokenSignInFailed { why: "throttled" }
        );
        if throttled && !self.first_throttled_in_window(address) {
            return;
        }
        let name = bounded(name, smolchat_auth::accounts::MAX_NAME_CHARS);
        let user = format!("user:{name}");
        let (action, target, detail) = match &event {
            AuthEvent::SignIn => ("auth.sign_in", user.clone(), String::new()),
            AuthEvent::SignInFailed { why } if *why == "throttled" => (
                "auth.sign_in_failed",
                user.clone(),
                format!(
                    "throttled (further throttled attempts from this address in the next {} s \
                     are refused without a row)",
                    THROTTLED_RECORD_WINDOW.as_secs()
                ),
            ),
            AuthEvent::SignInFailed { why } => {
                ("auth.sign_in_failed", user.clone(), (*why).to_string())
            }
            AuthEvent::SignUp => ("auth.sign_up", user.clone(), String::new()),
            AuthEvent::ExternalSignIn { how } => ("auth.sign_in", user.clone(), how.clone()),
            AuthEvent::SignOut => ("auth.sign_out", user.clone(), String::new()),
            AuthEvent::AdminTokenSignIn => (
                "auth.admin_sign_in",
                "admin".to_string(),
                "admin token".into(),
            ),
            AuthEvent::AdminTokenSignInFailed { why } => (
                "auth.admin_sign_in_failed",
                "admin".to_string(),
                format!("admin token {why}"),
            ),
            AuthEvent::PasswordChanged => ("auth.password_changed", user.clone(), String::new()),
            AuthEvent::KeyCreated { prefix } => {
                ("auth.key_created", format!("key:{prefix}"), String::new())
            }
            AuthEvent::KeyRevoked { id } => {
                ("auth.key_revoked", format!("key:{id}"), String::new())
            }
        };
        // A failed sign-in has no actor yet: the address tried the name.
        let actor = match event {
            AuthEvent::SignInFailed { .. } | AuthEvent::AdminTokenSignInFailed { .. } => {
                "anonymous".to_string()
            }
            AuthEvent::AdminTokenSignIn => "admin".to_string(),
            _ => user,
        };
        self.record(&actor, action, &target, address, &detail).await
    }
}

/// Entries as CSV (RFC 4180: every field quoted, quotes doubled), with a header line.
pub fn to_csv(entries: &[AuditEntry]) -> String {
    let quote = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    let mut out = String::from("time,actor,action,target,address,detail\r\n");
    for e in entries {
        let at = e.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let fields = [
            at.as_str(),
            &e.actor,
            &e.action,
            &e.target,
            &e.address,
            &e.detail,
        ];
        let line: Vec<String> = fields.iter().map(|f| quote(f)).collect();
        out.push_str(&line.join(","));
        out.push_str("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_cut_with_an_ellipsis() {
        assert_eq!(bounded("short", 10), "short");
        let long = "x".repeat(204_800);
        let cut = bounded(&long, MAX_NAME_FIELD_CHARS);
        assert_eq!(cut.chars().count(), MAX_NAME_FIELD_CHARS);
        assert!(cut.ends_with('…'));
        assert_eq!(bounded("ééé", 2), "é…");
    }

    #[test]
    fn csv_quotes_every_field() {
        let e = AuditEntry {
            id: "x".into(),
            at: chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default(),
            actor: "user:a".into(),
            action: "auth.sign_in".into(),
            target: "user:\"bob\", the 2nd".into(),
            address: "127.0.0.1".into(),
            detail: "line\nbreak".into(),
        };
        let csv = to_csv(&[e]);
        assert!(csv.starts_with("time,actor,action,target,address,detail\r\n"));
        assert!(csv.contains("\"user:\"\"bob\"\", the 2nd\""), "{csv}");
        assert!(csv.contains("\"line\nbreak\""), "{csv}");
    }
}
