//! Wiring: loads the model and opens the store from a [`Config`], then starts the scheduler (with
//! its model thread), the session registry and the services. The web layer serves a
//! [`Platform`], which hands out services (conversations, completions, accounts, admin, the
//! cluster) and never its parts: the store, the scheduler and the session registry stay inside.

use std::sync::Arc;
use std::time::{Duration, Instant};

use smolchat_auth::{Accounts, AccountsConfig, AdminAuth, AuthError, ThrottlePolicy};
use smolchat_serving::scheduler::ModelAlive;
use smolchat_serving::SchedulerStats;
use smolchat_text::prompt::PromptBuilder;

use crate::admin::Admin;
use crate::cluster::{Cluster, ClusterConfig};
use crate::completions::Completions;
use crate::config::Config;
use crate::conversations::{Conversations, ConversationsConfig};
use crate::models::load::{model_memory_bytes, start_scheduler};
pub use crate::models::{load_model, LoadModelError, ModelInfo};
use crate::models::{Models, ServedModel};
use crate::session::{GetInfo, Shutdown, Stop};
use crate::settings::SettingsLimits;
use crate::{SessionConfig, SessionShared, Sessions};
use smolchat_engine::Engine;
use smolchat_store::{Store, StoreError};
use smolchat_text::template::ChatTemplate;
use smolchat_text::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    #[error(transparent)]
    Model(#[from] LoadModelError),
    #[error("database {url}: {source}")]
    Store {
        url: String,
        #[source]
        source: StoreError,
    },
    #[error("server.cookie_secret: {0}")]
    Secret(#[from] crate::secrets::SecretError),
    #[error("auth: {0}")]
    Auth(AuthError),
}

pub struct Platform {
    config: Config,
    store: Store,
    /// Every model served; the main one always loaded.
    models: Arc<Models>,
    /// The main model (`[model]`).
    main: Arc<ServedModel>,
    sessions: Arc<Sessions>,
    /// This replica among those sharing the database.
    cluster: Arc<Cluster>,
    /// The conversation service every interface goes through.
    conversations: Arc<Conversations>,
    /// The completions service: every prompt any interface runs (conversations' turns and `/v1`).
    completions: Completions,
    /// Reads attached files, a PDF in a bounded child process (shared with `conversations`).
    documents: Arc<crate::documents::DocumentReader>,
    /// Collections of documents the chat can search, and their indexer.
    knowledge: Arc<crate::knowledge::Knowledge>,
    audit: crate::audit::Audit,
    accounts: Arc<Accounts>,
    /// Admin sign-in with `server.admin_token`; `None` when no token is set.
    admin_auth: Option<AdminAuth>,
    admin: Admin,
}

/// Whether this replica can take requests (`/readyz`).
#[derive(Debug, Clone)]
pub struct Readiness {
    /// The model thread runs.
    pub model_alive: bool,
    /// The database answered a ping in time, or why not.
    pub database: Result<(), String>,
    /// `sqlite` or `postgresql`.
    pub database_backend: &'static str,
    /// This replica's name.
    pub replica: String,
}

impl Platform {
    /// Opens the store and starts the actors around an already loaded model. Must run inside an
    /// actix system.
    pub async fn start(
        mut config: Config,
        engine: Engine,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        model: ModelInfo,
        sandbox: crate::documents::SandboxConfig,
    ) -> Result<Self, PlatformError> {
        let store =
            Store::open(&config.database.url)
                .await
                .map_err(|source| PlatformError::Store {
                    url: smolchat_store::redact_url(&config.database.url),
                    source,
                })?;
        // Without a configured secret, one generated on first start and kept beside the
        // database signs the owner cookies, so a restart never orphans anyone's conversations.
        if config.server.cookie_secret.is_none() {
            config.server.cookie_secret = Some(match store.data_dir() {
                Some(dir) => {
                    crate::secrets::load_or_create(dir, crate::secrets::COOKIE_SECRET_FILE)?
                }
                None => {
                    tracing::info!(
                        "server.cookie_secret is not set and the database is in memory: owner cookies are signed with a random key, so browsers lose their conversations when the server restarts"
                    );
                    crate::secrets::random_secret()
                }
            });
        }
        let secret = config.server.cookie_secret.clone().unwrap_or_default();
        let r = &config.replica;
        let (cluster, interrupted) = Cluster::join(
            store.clone(),
            ClusterConfig {
                name: r.name_or_default(&config.server.bind),
                url: r.url_or_default(&config.server.bind),
                heartbeat: r.heartbeat(),
                lease: r.lease(),
                affinity: r.affinity,
                bus_key: secret.clone().into_bytes(),
            },
        )
        .await
        .map_err(|source| PlatformError::Store {
            url: smolchat_store::redact_url(&config.database.url),
            source,
        })?;
        if interrupted > 0 {
            tracing::warn!(
                count = interrupted,
                "replies of earlier runs marked interrupted"
            );
        }
        // The audit log keeps `auth.audit_keep_days`: trimmed now and once a day after.
        {
            let audit = crate::audit::Audit::new(store.clone());
            let keep = config.auth.audit_keep_days;
            let purged = audit.purge(keep).await;
            if purged > 0 {
                tracing::info!(
                    entries = purged,
                    keep_days = keep,
                    "old audit log entries removed"
                );
            }
            // Usage windows no quota or history needs any more go the same way.
            let usage_store = store.clone();
            actix::spawn(async move {
                loop {
                    if let Err(e) = usage_store.trim_usage(chrono::Utc::now()).await {
                        tracing::warn!("cannot trim old usage counters: {e}");
                    }
                    tokio::time::sleep(std::time::Duration::from_secs(24 * 3600)).await;
                    audit.purge(keep).await;
                }
            });
        }
        let tokenizer = Arc::new(tokenizer);
        let template = Arc::new(template);
        let memory_bytes = model_memory_bytes(&engine);
        let meter = smolchat_serving::batcher::TokenMeter::default();
        let scheduler = start_scheduler(
            &config,
            engine,
            Arc::clone(&tokenizer),
            &model,
            &meter,
            None,
        );
        let l = &config.limits;
        let quotas = crate::quotas::Quotas::new(
            store.clone(),
            crate::quotas::QuotaLimits {
                per_minute_user: l.tokens_per_minute_per_user,
                per_minute_group: l.tokens_per_minute_per_guest_address,
                per_day_user: l.tokens_per_day_per_user,
                per_month_user: l.tokens_per_month_per_user,
                per_day_key: l.tokens_per_day_per_key,
                per_month_key: l.tokens_per_month_per_key,
            },
        );
        let completions = Completions::new(
            scheduler.clone(),
            store.clone(),
            model.context_window,
            quotas,
        );
        let main = Arc::new(ServedModel::new(
            model,
            Arc::clone(&tokenizer),
            Arc::clone(&template),
            scheduler.clone(),
            completions.clone(),
            memory_bytes,
            None,
        ));
        let models = Models::new(&config, Arc::clone(&main), meter, completions.clone());
        let documents = crate::documents::DocumentReader::new(
            sandbox,
            crate::documents::longest_token_bytes(&tokenizer),
        );
        let knowledge = crate::knowledge::Knowledge::new(
            store.clone(),
            Arc::clone(&models),
            Arc::clone(&documents),
            config.knowledge.clone(),
            config
                .limits
                .max_stored_mib_per_user
                .saturating_mul(1 << 20),
        );
        // Documents added (or cut off by a crash) and not indexed yet are taken up now.
        knowledge.start();
        let sessions = Sessions::new(SessionShared {
            store: store.clone(),
            models: Arc::clone(&models),
            cfg: SessionConfig {
                max_message_chars: config.limits.max_message_chars,
                idle_timeout: Duration::from_secs(config.session.idle_timeout_s),
                disconnect_grace: Duration::from_millis(config.session.disconnect_grace_ms),
            },
            cluster: Arc::clone(&cluster),
            knowledge: Arc::clone(&knowledge),
            tools: {
                let tools = crate::tools::Tools::new(config.tools.clone());
                // MCP servers connect in the background: none holds up the start.
                tools.start();
                Arc::new(tools)
            },
        });
        sessions.receive_from(&cluster);
        cluster.run(scheduler.clone());
        let conversations = Arc::new(Conversations::new(
            store.clone(),
            Arc::clone(&sessions),
            Arc::clone(&models),
            conversations_config(&config),
            Arc::clone(&documents),
        ));
        let key = credential_key(&secret);
        let accounts = Arc::new(accounts(&config, &store, key).await?);
        let admin_auth = admin_auth(&config, &store, key);
        let admin = Admin::new(
            store.clone(),
            Arc::clone(&models),
            Arc::clone(&cluster),
            Arc::clone(&conversations),
            Arc::clone(&accounts),
        );
        spawn_session_purge(store.clone());
        let audit = crate::audit::Audit::new(store.clone());
        Ok(Self {
            config,
            store,
            models,
            main,
            sessions,
            cluster,
            conversations,
            completions,
            documents,
            knowledge,
            audit,
            accounts,
            admin_auth,
            admin,
        })
    }

    /// The configuration in force (the cookie secret filled in when it was generated).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Every model served (the one rule for a request's model name, loading on demand).
    pub fn models(&self) -> &Arc<Models> {
        &self.models
    }

    /// Reads a file a `/v1` request carries inline (a `file` content part) for the caller
    /// `who` (an account, a key, an address): checked, its text extracted (a PDF in the
    /// sandboxed reader) under `limits.max_file_mib` and the reading limits, the same rules as
    /// an upload to a conversation.
    pub async fn read_inline_file(
        &self,
        who: &str,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<crate::files::Extracted, crate::documents::ReadError> {
        let limit = self.conversations.config().max_file_bytes;
        // The prompt it goes into is checked against the context window once it is built; a
        // text that could not fit the window is refused before that (and before anything
        // tokenizes it whole).
        self.documents
            .read(who, name, bytes, limit, self.main.info().context_window)
            .await
    }

    /// Collections of documents, their indexing and search.
    pub fn knowledge(&self) -> &crate::knowledge::Knowledge {
        &self.knowledge
    }

    /// The conversation service every interface goes through.
    pub fn conversations(&self) -> &Conversations {
        &self.conversations
    }

    /// The completions service (`/v1` submits through it).
    pub fn completions(&self) -> &Completions {
        &self.completions
    }

    /// User accounts: sign-up, sign-in, sessions, API keys.
    pub fn accounts(&self) -> &Accounts {
        &self.accounts
    }

    /// Admin sign-in with `server.admin_token`; `None` when no token is set.
    pub fn admin_auth(&self) -> Option<&AdminAuth> {
        self.admin_auth.as_ref()
    }

    /// The operator's service (`/admin`).
    pub fn admin(&self) -> &Admin {
        &self.admin
    }

    /// The audit log: what is recorded, and reading it (admins). One for the process, so what
    /// it remembers (throttled addresses) holds across requests.
    pub fn audit(&self) -> crate::audit::Audit {
        self.audit.clone()
    }

    /// This replica among those sharing the database (routing of turns to their cache).
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Facts about the loaded model.
    pub fn model(&self) -> &ModelInfo {
        self.main.info()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        self.main.tokenizer()
    }

    pub fn template(&self) -> &ChatTemplate {
        self.main.template()
    }

    /// The one prompt builder over this model's template and tokenizer.
    pub fn prompt_builder(&self) -> PromptBuilder<'_> {
        self.main.prompt_builder()
    }

    /// Whether this replica can take requests: the model thread runs and the database answers
    /// within [`DATABASE_CHECK`].
    pub async fn readiness(&self) -> Readiness {
        let model_alive = self.main.scheduler().connected()
            && self
                .main
                .scheduler()
                .send(ModelAlive)
                .await
                .unwrap_or(false);
        let database = match tokio::time::timeout(DATABASE_CHECK, self.store.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "no answer within {} s",
                DATABASE_CHECK.as_secs_f64()
            )),
        };
        Readiness {
            model_alive,
            database,
            database_backend: self.store.backend().as_str(),
            replica: self.cluster.me().name.clone(),
        }
    }

    /// The scheduler's counters now; `None` once the model thread is gone.
    pub async fn stats(&self) -> Option<SchedulerStats> {
        self.main.stats().await
    }

    /// Sets the gauges the scheduler updates only at its steps, so an idle server reports
    /// current values too (called before `/metrics` renders).
    pub async fn refresh_gauges(&self) {
        // Every model's, labelled, and their sums unlabelled (what one model reported before).
        let mut sums = SchedulerStats::default();
        for status in self.models.list() {
            let label = status.id.clone();
            let loaded = status.state == crate::models::LoadState::Loaded;
            metrics::gauge!("smolchat_model_loaded", "model" => label.clone()).set(if loaded {
                1.0
            } else {
                0.0
            });
            metrics::gauge!("smolchat_model_memory_bytes", "model" => label.clone()).set(
                if loaded {
                    status.memory_bytes as f64
                } else {
                    0.0
                },
            );
            let stats = match self.models.peek(&status.id) {
                Some(m) => m.stats().await,
                None => None,
            };
            let s = stats.unwrap_or_default();
            for (name, value) in [
                ("smolchat_model_queue_depth", s.queued as f64),
                ("smolchat_model_running_sequences", s.running as f64),
                ("smolchat_model_tokens_per_second", s.tokens_per_s),
                ("smolchat_model_kv_bytes", s.kv_bytes as f64),
            ] {
                metrics::gauge!(name, "model" => label.clone()).set(value);
            }
            sums.queued += s.queued;
            sums.running += s.running;
            sums.tokens_per_s += s.tokens_per_s;
            sums.kv_bytes += s.kv_bytes;
            sums.kv_budget_bytes += s.kv_budget_bytes;
            sums.evictions += s.evictions;
        }
        metrics::gauge!("smolchat_queue_depth").set(sums.queued as f64);
        metrics::gauge!("smolchat_running_sequences").set(sums.running as f64);
        metrics::gauge!("smolchat_kv_bytes").set(sums.kv_bytes as f64);
        metrics::gauge!("smolchat_kv_budget_bytes").set(sums.kv_budget_bytes as f64);
        metrics::gauge!("smolchat_kv_evictions").set(sums.evictions as f64);
        metrics::gauge!("smolchat_tokens_per_second").set(sums.tokens_per_s);
        if let Some(s) = self.stats().await {
            if let Some(m) = s.device_memory {
                for (part, bytes) in [
                    ("weights", m.weights_bytes),
                    ("kv", m.kv_bytes),
                    ("free", m.free_bytes),
                    ("total", m.total_bytes),
                ] {
                    metrics::gauge!("smolchat_gpu_memory_bytes", "part" => part).set(bytes as f64);
                }
            }
            if let Some(g) = s.graphs {
                for (event, n) in [
                    ("warmup", g.warmups),
                    ("capture", g.captures),
                    ("replay", g.replays),
                    ("invalidated", g.invalidated),
                ] {
                    metrics::gauge!("smolchat_cuda_graph_events", "event" => event).set(n as f64);
                }
            }
        }
        metrics::gauge!("smolchat_live_sessions").set(self.sessions.all().len() as f64);
        // Which device and tier compute, as an info gauge (always 1), and whether the GPU's
        // fast tier was set aside (its self-check failed, or the file needs the reference tier).
        let m = self.main.info();
        metrics::gauge!("smolchat_engine_info", "device" => m.device.clone(), "tier" => m.tier.clone())
            .set(1.0);
        metrics::gauge!("smolchat_engine_tier_fallback").set(if m.tier_note.is_some() {
            1.0
        } else {
            0.0
        });
        metrics::gauge!("smolchat_live_replicas").set(self.cluster.live().len() as f64);
    }

    /// After the server stopped: leaves the cluster and closes the store.
    pub async fn close(&self) {
        // Idle conversations' caches to disk, so the next start resumes them without computing
        // their prompts (bounded: a stop is not held up for long).
        let spilled = tokio::time::timeout(SPILL_AT_STOP, self.models.spill_all()).await;
        if spilled.is_err() {
            tracing::warn!("writing KV caches to the spill tier took too long; stopping anyway");
        }
        self.cluster.leave().await;
        self.store.close().await;
    }
}

/// How long a stopping server spends writing idle KV caches to the spill tier.
const SPILL_AT_STOP: Duration = Duration::from_secs(20);

/// How long readiness waits for the database.
pub const DATABASE_CHECK: Duration = Duration::from_secs(2);

/// How often expired sessions are deleted.
const SESSION_PURGE_INTERVAL: Duration = Duration::from_secs(3600);

/// Deletes expired sessions (user and admin) hourly, whoever signs in or not.
fn spawn_session_purge(store: Store) {
    actix::spawn(async move {
        let mut tick = tokio::time::interval(SESSION_PURGE_INTERVAL);
        loop {
            tick.tick().await;
            match store.purge_expired_sessions().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(purged = n, "expired sessions purged"),
                Err(e) => tracing::warn!("cannot purge expired sessions: {e}"),
            }
        }
    });
}

/// The key credential fingerprints are made with: the signing half of the cookie key the web
/// layer derives from the same secret (its first 32 bytes), so sessions made before this code
/// moved stay valid. The secret has at least 64 bytes (checked at start-up).
fn credential_key(secret: &str) -> &[u8] {
    let bytes = secret.as_bytes();
    &bytes[..bytes.len().min(32)]
}

/// The login throttle's policy from `[auth]`.
pub fn throttle_policy(a: &crate::config::AuthSection) -> ThrottlePolicy {
    ThrottlePolicy {
        free_per_address: a.login_free_failures_per_address,
        free_per_subject: a.login_free_failures_per_account,
        base_lockout: Duration::from_secs(a.login_lockout_base_s),
        max_lockout: Duration::from_secs(a.login_lockout_max_s),
        max_entries: a.login_throttle_entries,
    }
}

/// The accounts service; creates `auth.initial_admin` when the store has no account yet.
async fn accounts(config: &Config, store: &Store, key: &[u8]) -> Result<Accounts, PlatformError> {
    let a = &config.auth;
    if let (Some(name), Some(password)) = (&a.initial_admin, &a.initial_admin_password) {
        if smolchat_auth::accounts::ensure_initial_admin(store, name, password)
            .await
            .map_err(PlatformError::Auth)?
        {
            tracing::info!(name = %name, "initial admin account created from auth.initial_admin");
        }
    }
    Accounts::new(
        store.clone(),
        key,
        AccountsConfig {
            signup: a.signup,
            session_lifetime: Duration::from_secs(a.user_session_s),
            throttle: throttle_policy(a),
            signups_per_address: a.signups_per_address,
            max_api_keys: a.max_api_keys_per_user,
            max_sessions: a.max_sessions_per_user,
            password_login: a.password_login,
            oidc: a.oidc.clone(),
        },
    )
    .map_err(PlatformError::Auth)
}

/// The admin sign-in service for `server.admin_token` (none when unset or empty).
fn admin_auth(config: &Config, store: &Store, key: &[u8]) -> Option<AdminAuth> {
    let token = config
        .server
        .admin_token
        .as_deref()
        .filter(|t| !t.is_empty())?;
    Some(AdminAuth::new(
        store.clone(),
        token,
        // Kept across restarts (configured, or generated once into the data folder), so admin
        // sessions survive a restart with the same token.
        key,
        Duration::from_secs(config.auth.admin_session_s),
        throttle_policy(&config.auth),
    ))
}

impl Platform {
    /// Shutdown draining: stops every running reply, waits (bounded) until each is stored,
    /// then ends the sessions.
    pub async fn drain(&self) {
        let sessions = self.sessions.all();
        let mut stopped = 0;
        for (_, session) in &sessions {
            if session.send(Stop).await.unwrap_or(false) {
                stopped += 1;
            }
        }
        if stopped > 0 {
            tracing::info!(replies = stopped, "stopping running replies");
        }
        let deadline = Instant::now() + DRAIN_REPLIES;
        loop {
            let mut busy = 0;
            for (_, session) in &sessions {
                if session.send(GetInfo).await.is_ok_and(|i| i.replying) {
                    busy += 1;
                }
            }
            if busy == 0 {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    replies = busy,
                    "replies still running at shutdown; they will read as interrupted"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for (_, session) in &sessions {
            let _ = session.send(Shutdown).await;
        }
        // The usage rows and quota counts of the requests that just ended.
        let left = self.completions().settle(DRAIN_WRITES).await;
        if left > 0 {
            tracing::warn!(
                writes = left,
                "usage writes still running at shutdown are dropped"
            );
        }
    }
}

/// How long shutdown waits for finished requests' usage writes.
const DRAIN_WRITES: Duration = Duration::from_secs(5);

/// How long shutdown waits for stopped replies to be stored.
const DRAIN_REPLIES: Duration = Duration::from_secs(5);

/// The conversation service's settings: `[limits]`, and `[sampling]` for new conversations.
pub fn conversations_config(config: &Config) -> ConversationsConfig {
    let s = &config.sampling;
    let l = &config.limits;
    ConversationsConfig {
        settings_limits: SettingsLimits {
            max_prompt_chars: l.max_message_chars,
            max_new_tokens: l.max_new_tokens,
        },
        max_message_chars: l.max_message_chars,
        conversations_per_minute: l.conversations_per_minute,
        max_conversations_per_user: l.max_conversations_per_user,
        max_import_messages: l.max_import_messages,
        max_stored_bytes_per_user: l.max_stored_mib_per_user.saturating_mul(1 << 20),
        import_bytes_per_address_per_hour: l
            .import_mib_per_address_per_hour
            .saturating_mul(1 << 20),
        searches_per_minute: l.searches_per_minute,
        max_file_bytes: usize::try_from(l.max_file_mib.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX),
        max_files_per_message: l.max_files_per_message,
        max_file_bytes_per_user: l.max_file_mib_per_user.saturating_mul(1 << 20),
        defaults: smolchat_store::ConversationSettings {
            system_prompt: s.system_prompt.clone().filter(|p| !p.trim().is_empty()),
            thinking: s.thinking,
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            max_tokens: s.max_tokens.min(l.max_new_tokens),
            seed: None,
            ..smolchat_store::ConversationSettings::default()
        },
    }
}
