//! The operator's service: every conversation of every owner with its live state, the engine and
//! the replicas, the users table, and the admin actions (stop, evict, delete; disable, enable,
//! revoke a user's sessions). `/admin` in the web layer checks that the caller is an admin, calls
//! this and renders what it returns; the rules (such as "an admin cannot disable their own
//! account") are here.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use smolchat_auth::Accounts;
use smolchat_serving::scheduler::{GetCacheInfo, GetStats, StatesOf};
use smolchat_serving::{SchedulerStats, SequenceState};
use smolchat_store::{
    ConversationSummary, Cursor, PageRequest, ReplicaRecord, Store, UserOverview,
};
use uuid::Uuid;

use crate::caller::Caller;
use crate::cluster::Cluster;
use crate::conversations::{ConversationError, Conversations};

type Result<T, E = ConversationError> = std::result::Result<T, E>;

/// Users per page of the users table.
pub const USERS_PER_PAGE: i64 = 50;

/// One conversation on the operator's table.
#[derive(Debug, Clone)]
pub struct LiveConversation {
    pub summary: ConversationSummary,
    /// The owning account's name; `None` for a guest.
    pub owner_name: Option<String>,
    /// What the scheduler is doing for it on this replica.
    pub state: SequenceState,
    /// Bytes of KV cache this replica holds for it.
    pub kv_bytes: Option<usize>,
    /// The live replica that holds its KV cache, by name.
    pub replica: Option<String>,
    /// Speculative decoding on this replica since its cache was made: (drafted, accepted,
    /// verifying steps); `None` when nothing was drafted.
    pub speculation: Option<(u64, u64, u64)>,
}

/// The live part of the admin page: this replica's engine, every replica, one page of
/// conversations.
#[derive(Debug, Clone)]
pub struct LiveView {
    /// The main model's scheduler.
    pub stats: SchedulerStats,
    /// Every configured model, with its scheduler's counters while it is loaded.
    pub models: Vec<ModelRow>,
    /// Every replica on the database, live or gone within the hour.
    pub replicas: Vec<ReplicaRecord>,
    /// This replica's id (to mark it among `replicas`).
    pub this_replica: Uuid,
    pub conversations: Vec<LiveConversation>,
    /// The next (older) page, if any.
    pub next: Option<Cursor>,
}

/// A model on the admin page.
#[derive(Debug, Clone)]
pub struct ModelRow {
    pub status: crate::models::ModelStatus,
    pub stats: Option<SchedulerStats>,
}

/// One page of the users table.
#[derive(Debug, Clone)]
pub struct UsersPage {
    pub users: Vec<UserOverview>,
    /// The page shown, from 1.
    pub page: i64,
    pub has_more: bool,
}

/// What an admin can do to an account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UserAction {
    Disable,
    Enable,
    /// Sign the user out everywhere.
    RevokeSessions,
    /// Give the admin role.
    MakeAdmin,
    /// Take the admin role.
    MakeUser,
}

impl FromStr for UserAction {
    type Err = ConversationError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "disable" => Ok(Self::Disable),
            "enable" => Ok(Self::Enable),
            "revoke" => Ok(Self::RevokeSessions),
            "make-admin" => Ok(Self::MakeAdmin),
            "make-user" => Ok(Self::MakeUser),
            other => Err(ConversationError::NoSuch(format!(
                "no user action {other:?}"
            ))),
        }
    }
}

/// The admin service (see the module docs).
pub struct Admin {
    store: Store,
    audit: crate::audit::Audit,
    models: Arc<crate::models::Models>,
    cluster: Arc<Cluster>,
    conversations: Arc<Conversations>,
    accounts: Arc<Accounts>,
}

impl Admin {
    pub fn new(
        store: Store,
        models: Arc<crate::models::Models>,
        cluster: Arc<Cluster>,
        conversations: Arc<Conversations>,
        accounts: Arc<Accounts>,
    ) -> Self {
        Self {
            audit: crate::audit::Audit::new(store.clone()),
            store,
            models,
            cluster,
            conversations,
            accounts,
        }
    }

    /// The engine, the replicas and one page of every owner's conversations with their live
    /// state.
    pub async fn live(&self, page: &PageRequest) -> Result<LiveView> {
        let listed = self.store.list_all_conversations_page(page).await?;
        let ids: Vec<Uuid> = listed.items.iter().map(|c| c.id).collect();
        // A conversation's state and caches on every loaded model (a conversation that
        // switched models may hold a cache on each).
        let mut states = vec![SequenceState::Idle; ids.len()];
        let mut cache_info = Vec::new();
        for m in self.models.all_loaded() {
            let on = m
                .scheduler()
                .send(StatesOf(ids.clone()))
                .await
                .map_err(gone)?;
            for (kept, state) in states.iter_mut().zip(on) {
                if *kept == SequenceState::Idle {
                    *kept = state;
                }
            }
            cache_info.extend(m.scheduler().send(GetCacheInfo).await.map_err(gone)?);
        }
        let mut caches: HashMap<Uuid, usize> = HashMap::new();
        for c in &cache_info {
            if let Some(id) = c.key.conversation() {
                *caches.entry(id).or_default() += c.bytes;
            }
        }
        let drafts: HashMap<Uuid, (u64, u64, u64)> = cache_info
            .iter()
            .filter(|c| c.drafted > 0)
            .filter_map(|c| {
                Some((
                    c.key.conversation()?,
                    (c.drafted, c.accepted, c.verify_steps),
                ))
            })
            .collect();
        let stats = self
            .models
            .main()
            .scheduler()
            .send(GetStats)
            .await
            .map_err(gone)?;
        let models = self.models().await;
        let mut owners: Vec<String> = listed.items.iter().map(|c| c.owner.clone()).collect();
        owners.sort();
        owners.dedup();
        let names = self.store.user_names(&owners).await?;
        let replicas = self.cluster.replicas().await?;
        let mut holders: HashMap<Uuid, String> = HashMap::new();
        for r in replicas.iter().filter(|r| r.live) {
            for id in &r.load.held {
                holders.insert(*id, r.name.clone());
            }
        }
        let conversations = listed
            .items
            .into_iter()
            .zip(
                states
                    .into_iter()
                    .chain(std::iter::repeat(SequenceState::Idle)),
            )
            .map(|(summary, state)| LiveConversation {
                owner_name: names.get(&summary.owner).cloned(),
                kv_bytes: caches.get(&summary.id).copied(),
                speculation: drafts.get(&summary.id).copied(),
                replica: holders.get(&summary.id).cloned(),
                state,
                summary,
            })
            .collect();
        Ok(LiveView {
            stats,
            models,
            replicas,
            this_replica: self.cluster.me().id,
            conversations,
            next: listed.next,
        })
    }

    /// Every configured model, with its counters while loaded.
    pub async fn models(&self) -> Vec<ModelRow> {
        let mut rows = Vec::new();
        for status in self.models.list() {
            let stats = match self.models.peek(&status.id) {
                Some(m) => m.stats().await,
                None => None,
            };
            rows.push(ModelRow { status, stats });
        }
        rows
    }

    /// Loads a model now (an admin); recorded in the audit log.
    pub async fn load_model(
        &self,
        by: &Caller,
        id: &str,
    ) -> std::result::Result<(), crate::models::ModelError> {
        let id = self.models.find(id)?;
        let result = self.models.load(&id).await.map(|_| ());
        let detail = match &result {
            Ok(()) => "loaded".to_string(),
            Err(e) => e.to_string(),
        };
        self.audit
            .record_by(by, "admin.model_load", &format!("model:{id}"), &detail)
            .await;
        result
    }

    /// Unloads a model now (an admin): refused for the main model and while it has requests.
    pub async fn unload_model(
        &self,
        by: &Caller,
        id: &str,
    ) -> std::result::Result<bool, crate::models::ModelError> {
        let id = self.models.find(id)?;
        let result = self.models.unload(&id).await;
        let detail = match &result {
            Ok(true) => "unloaded".to_string(),
            Ok(false) => "was not loaded".to_string(),
            Err(e) => e.to_string(),
        };
        self.audit
            .record_by(by, "admin.model_unload", &format!("model:{id}"), &detail)
            .await;
        result
    }

    /// Makes a model the default for new conversations and requests naming none (until the
    /// server restarts); recorded in the audit log.
    pub async fn set_default_model(
        &self,
        by: &Caller,
        id: &str,
    ) -> std::result::Result<String, crate::models::ModelError> {
        let id = self.models.set_default(id)?;
        self.audit
            .record_by(by, "admin.model_default", &format!("model:{id}"), "")
            .await;
        Ok(id)
    }

    /// Page `page` (from 1; out-of-range values are clamped) of the users table.
    pub async fn users(&self, page: i64) -> Result<UsersPage> {
        let page = page.clamp(1, i64::MAX / USERS_PER_PAGE);
        // One more than a page, to know whether a next page exists.
        let mut users = self
            .store
            .list_users(USERS_PER_PAGE + 1, (page - 1) * USERS_PER_PAGE)
            .await?;
        let has_more = users.len() as i64 > USERS_PER_PAGE;
        users.truncate(USERS_PER_PAGE as usize);
        Ok(UsersPage {
            users,
            page,
            has_more,
        })
    }

    /// `action` on the account `user_id`, by the admin `by`.
    pub async fn user_action(&self, by: &Caller, user_id: &str, action: UserAction) -> Result<()> {
        if matches!(action, UserAction::Disable | UserAction::MakeUser)
            && !by.guest
            && by.owner == user_id
        {
            // The last admin could otherwise lock everyone out of the page.
            return Err(ConversationError::Invalid {
                field: None,
                message: "you cannot disable your own account or take your own admin role; \
                          ask another admin"
                    .into(),
            });
        }
        let found = match action {
            UserAction::Disable => self.accounts.set_disabled(user_id, true).await,
            UserAction::Enable => self.accounts.set_disabled(user_id, false).await,
            UserAction::RevokeSessions => self.accounts.revoke_all_sessions(user_id).await,
            UserAction::MakeAdmin | UserAction::MakeUser => {
                let role = if action == UserAction::MakeAdmin {
                    smolchat_store::UserRole::Admin
                } else {
                    smolchat_store::UserRole::User
                };
                self.store
                    .set_user_role(user_id, role)
                    .await
                    .map_err(smolchat_auth::AuthError::from)
            }
        }
        .map_err(crate::conversations::from_auth)?;
        if !found {
            return Err(ConversationError::NoSuch("no such user".into()));
        }
        tracing::info!(user = %user_id, action = ?action, "admin user action");
        let name = match self.accounts.user(user_id).await {
            Ok(Some(u)) => u.name,
            _ => user_id.to_string(),
        };
        let what = match action {
            UserAction::Disable => "admin.disable_user",
            UserAction::Enable => "admin.enable_user",
            UserAction::RevokeSessions => "admin.revoke_sessions",
            UserAction::MakeAdmin => "admin.role_changed",
            UserAction::MakeUser => "admin.role_changed",
        };
        let detail = match action {
            UserAction::MakeAdmin => "to admin",
            UserAction::MakeUser => "to user",
            _ => "",
        };
        self.audit
            .record_by(by, what, &format!("user:{name}"), detail)
            .await;
        Ok(())
    }

    /// Makes an account (`admin`: with the admin role), as `smolchat user add` does.
    pub async fn create_user(
        &self,
        by: &Caller,
        name: &str,
        password: &str,
        admin: bool,
    ) -> Result<()> {
        let role = if admin {
            smolchat_store::UserRole::Admin
        } else {
            smolchat_store::UserRole::User
        };
        let user = smolchat_auth::accounts::add_user(&self.store, name.trim(), password, role)
            .await
            .map_err(account_refusal)?;
        self.audit
            .record_by(
                by,
                "admin.create_user",
                &format!("user:{}", user.name),
                if admin { "admin" } else { "user" },
            )
            .await;
        Ok(())
    }

    /// A single-use sign-up invite valid for `days`; its code (shown once).
    pub async fn create_invite(&self, by: &Caller, days: u64) -> Result<String> {
        if !(1..=90).contains(&days) {
            return Err(ConversationError::Invalid {
                field: Some("days"),
                message: format!("an invite lasts 1 to 90 days, not {days}"),
            });
        }
        let code = smolchat_auth::accounts::create_invite(
            &self.store,
            std::time::Duration::from_secs(days * 86_400),
        )
        .await
        .map_err(crate::conversations::from_auth)?;
        self.audit
            .record_by(by, "admin.create_invite", "", &format!("valid {days} days"))
            .await;
        Ok(code)
    }

    /// Resets account `user_id`'s password to a random one, returned to be handed over once:
    /// their sessions end, and their next sign-in must choose a new password before anything
    /// else (as `smolchat user passwd --reset` does).
    /// Their live personal API keys are revoked too. Returns the account's name and the reset
    /// (the new password, the keys revoked).
    pub async fn reset_password(
        &self,
        by: &Caller,
        user_id: &str,
    ) -> Result<(String, smolchat_auth::accounts::PasswordReset)> {
        let user = self.account(user_id).await?;
        let reset = smolchat_auth::accounts::reset_password(&self.store, &user)
            .await
            .map_err(account_refusal)?;
        tracing::info!(user = %user_id, "admin reset a password");
        self.audit
            .record_by(
                by,
                "admin.reset_password",
                &format!("user:{}", user.name),
                &format!(
                    "must change at next sign-in; {} API keys revoked",
                    reset.keys_revoked
                ),
            )
            .await;
        Ok((user.name, reset))
    }

    /// Invite links not yet used or expired, newest first.
    pub async fn invites(&self) -> Result<Vec<smolchat_store::InviteRecord>> {
        Ok(self.store.live_invites().await?)
    }

    /// Ends invite `id` (the SHA-256 of its code) before anyone uses it.
    pub async fn revoke_invite(&self, by: &Caller, id: &str) -> Result<()> {
        if !self.store.revoke_invite(id).await? {
            return Err(ConversationError::NoSuch(
                "no such invite: it was used, expired or revoked already".into(),
            ));
        }
        let short: String = id.chars().take(12).collect();
        self.audit
            .record_by(by, "admin.revoke_invite", &format!("invite:{short}"), "")
            .await;
        Ok(())
    }

    /// Account `user_id`'s tokens and requests per UTC day, newest first, at most `days`
    /// (counted on every replica; see [`crate::quotas`]).
    pub async fn usage_history(
        &self,
        user_id: &str,
        days: usize,
    ) -> Result<(
        smolchat_store::User,
        Vec<(chrono::DateTime<chrono::Utc>, i64, i64)>,
    )> {
        let user = self.account(user_id).await?;
        let days = self
            .store
            .usage_history(
                &format!("user:{user_id}"),
                smolchat_store::Period::Day,
                days,
            )
            .await?
            .into_iter()
            .map(|(day, u)| (day, u.tokens, u.events))
            .collect();
        Ok((user, days))
    }

    /// The account `user_id`, or `NoSuch`.
    async fn account(&self, user_id: &str) -> Result<smolchat_store::User> {
        self.accounts
            .user(user_id)
            .await
            .map_err(crate::conversations::from_auth)?
            .ok_or_else(|| ConversationError::NoSuch("no such user".into()))
    }

    /// Deletes the account `user_id` with all it owns (conversations, their replies stopped
    /// and caches dropped, folders, presets, keys, sessions), once `confirm` is its name.
    pub async fn delete_user(&self, by: &Caller, user_id: &str, confirm: &str) -> Result<()> {
        let user = self.account(user_id).await?;
        if confirm.trim() != user.name {
            return Err(ConversationError::Invalid {
                field: Some("confirm"),
                message: format!(
                    "to delete {:?} and everything they own, confirm with their name",
                    user.name
                ),
            });
        }
        if !by.guest && by.owner == user_id {
            return Err(ConversationError::Invalid {
                field: None,
                message: "you cannot delete your own account; ask another admin".into(),
            });
        }
        // Running replies stop and caches go first (the sessions hold them), then one
        // transaction removes the rest.
        let owned = self.store.list_conversations(user_id, None).await?;
        for c in &owned {
            self.conversations.delete_any(c.id).await?;
        }
        let gone = self
            .store
            .delete_user(user_id)
            .await?
            .ok_or_else(|| ConversationError::NoSuch("no such user".into()))?;
        tracing::info!(user = %user_id, "admin deleted a user");
        self.audit
            .record_by(
                by,
                "admin.delete_user",
                &format!("user:{}", user.name),
                &format!(
                    "{} conversations, {} API keys, {} sessions",
                    owned.len() as i64 + gone.conversations,
                    gone.api_keys,
                    gone.sessions
                ),
            )
            .await;
        Ok(())
    }

    /// A page of the audit log matching `filter`, newest first: admins only.
    pub async fn audit(
        &self,
        by: &Caller,
        filter: &smolchat_store::AuditFilter,
        limit: usize,
    ) -> Result<Vec<smolchat_store::AuditEntry>> {
        if !by.admin {
            return Err(ConversationError::Forbidden(
                "only admins read the audit log".into(),
            ));
        }
        Ok(self.audit.entries(filter, limit).await?)
    }

    /// Stops the conversation's running reply; whether one was running.
    pub async fn stop(&self, by: &Caller, id: Uuid) -> Result<bool> {
        let stopped = self.conversations.stop_any(id).await?;
        tracing::info!(conversation = %id, stopped, "admin stop");
        let detail = if stopped {
            "a reply was running"
        } else {
            "nothing was running"
        };
        self.audit
            .record_by(by, "admin.stop", &format!("conversation:{id}"), detail)
            .await;
        Ok(stopped)
    }

    /// Drops the conversation's KV cache on this replica; whether it had one.
    pub async fn evict(&self, by: &Caller, id: Uuid) -> Result<bool> {
        let dropped = self.models.evict(id, true).await;
        tracing::info!(conversation = %id, dropped, "admin evict");
        self.audit
            .record_by(by, "admin.evict", &format!("conversation:{id}"), "")
            .await;
        Ok(dropped)
    }

    /// Deletes any owner's conversation.
    pub async fn delete(&self, by: &Caller, id: Uuid) -> Result<()> {
        let owner = self
            .store
            .get_conversation(id)
            .await?
            .map(|c| c.owner)
            .unwrap_or_default();
        self.conversations.delete_any(id).await?;
        tracing::info!(conversation = %id, "admin delete");
        self.audit
            .record_by(
                by,
                "admin.delete_conversation",
                &format!("conversation:{id}"),
                &format!("owner {owner}"),
            )
            .await;
        Ok(())
    }
}

fn gone(e: actix::MailboxError) -> ConversationError {
    ConversationError::Unavailable(format!("the scheduler is not available ({e}); retry"))
}

/// An account the admin asked for, refused: what was wrong with it, as the field's error.
fn account_refusal(e: smolchat_auth::AuthError) -> ConversationError {
    use smolchat_auth::AuthError;
    match e {
        AuthError::BadName(_) | AuthError::NameTaken => ConversationError::Invalid {
            field: Some("name"),
            message: e.to_string(),
        },
        AuthError::BadPassword(_) => ConversationError::Invalid {
            field: Some("password"),
            message: e.to_string(),
        },
        other => crate::conversations::from_auth(other),
    }
}
