//! Wiring: loads the model and opens the store from a [`Config`], then starts the scheduler (with
//! its model thread), the session registry and the services. The web layer serves a
//! [`Platform`], which hands out services (conversations, completions, accounts, admin, the
//! cluster) and never its parts: the store, the scheduler and the session registry stay inside.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use smolchat_auth::{Accounts, AccountsConfig, AdminAuth, AuthError, ThrottlePolicy};
use smolchat_serving::scheduler::{GetStats, ModelAlive};
use smolchat_serving::SchedulerStats;
use smolchat_text::prompt::PromptBuilder;

use crate::admin::Admin;
use crate::cluster::{Cluster, ClusterConfig};
use crate::completions::Completions;
use crate::config::Config;
use crate::conversations::{Conversations, ConversationsConfig};
use crate::session::{GetInfo, Shutdown, Stop};
use crate::settings::SettingsLimits;
use crate::{SessionConfig, SessionShared, Sessions};
use smolchat_engine::{Engine, EngineError};
use smolchat_serving::batcher::BatcherConfig;
use smolchat_serving::load::{self, LoadError};
use smolchat_serving::{SchedulerActor, SchedulerConfig};
use smolchat_store::{Store, StoreError};
use smolchat_text::template::ChatTemplate;
use smolchat_text::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    #[error("model {path}: {source}")]
    Model {
        path: String,
        #[source]
        source: LoadError,
    },
    #[error("{0}")]
    MissingModel(String),
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
    #[error("model.{0}")]
    Device(EngineError),
}

/// Facts about the loaded model that the web layer shows.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model's id in the API (the GGUF's name, or the file stem).
    pub id: String,
    pub path: String,
    pub architecture: String,
    pub context_window: usize,
    pub vocab_size: usize,
    /// Entries of the model's hidden state (the length of its embeddings).
    pub hidden_size: usize,
    pub weight_bytes: usize,
    pub load_s: f64,
    /// Where the model computes (`cpu`, `cuda:0`).
    pub device: String,
    /// Which path computes there (`cpu`, `reference`, `fast`).
    pub tier: String,
    /// Why that is not the tier asked for, when it is not (a failed GPU self-check, say).
    pub tier_note: Option<String>,
    /// What a KV cache saved to disk is valid for (see `kv_identity`).
    pub kv_identity: String,
    /// Other names clients may send for it (`model.aliases`).
    pub aliases: Vec<String>,
    /// Whether it answers requests naming a model the server does not have
    /// (`model.answer_unknown_names`).
    pub answers_unknown_names: bool,
}

impl ModelInfo {
    /// Whether a request's `model` means this model: none or an empty name (lenient, like
    /// llama-server), its id, its file's name (what llama-server clients often send; never the
    /// path, which would let a client probe the server's disk), one of its aliases, or any name
    /// when it answers unknown names. The one rule every API dialect asks.
    pub fn answers_to(&self, name: &str) -> bool {
        name.is_empty() || self.is_named(name) || self.answers_unknown_names
    }

    /// Whether `name` is this model's id, one of its aliases (the names `/v1/models` lists) or
    /// its file's name.
    pub fn is_named(&self, name: &str) -> bool {
        name == self.id
            || self.aliases.iter().any(|a| a == name)
            || std::path::Path::new(&self.path)
                .file_name()
                .is_some_and(|f| f.to_string_lossy() == name)
    }
}

pub struct Platform {
    config: Config,
    store: Store,
    scheduler: Addr<SchedulerActor>,
    sessions: Arc<Sessions>,
    /// This replica among those sharing the database.
    cluster: Arc<Cluster>,
    /// The conversation service every interface goes through.
    conversations: Arc<Conversations>,
    /// The completions service: every prompt any interface runs (conversations' turns and `/v1`).
    completions: Completions,
    /// Reads attached files, a PDF in a bounded child process (shared with `conversations`).
    documents: Arc<crate::documents::DocumentReader>,
    audit: crate::audit::Audit,
    accounts: Arc<Accounts>,
    /// Admin sign-in with `server.admin_token`; `None` when no token is set.
    admin_auth: Option<AdminAuth>,
    admin: Admin,
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    model: ModelInfo,
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

/// `kv-spill` beside a SQLite database's file (the data folder), `data/kv-spill` otherwise.
fn default_spill_dir(database_url: &str) -> std::path::PathBuf {
    let file = database_url
        .strip_prefix("sqlite://")
        .or_else(|| database_url.strip_prefix("sqlite:"))
        .filter(|f| !f.contains(":memory:") && !f.contains("mode=memory"))
        .map(|f| f.split('?').next().unwrap_or(f));
    match file.and_then(|f| std::path::Path::new(f).parent()) {
        Some(dir) => dir.join("kv-spill"),
        None => std::path::PathBuf::from("data/kv-spill"),
    }
}

/// The spill folder's name for this replica: `replica.name` when set; on a SQLite database (one
/// server) `local`, so a restart on another port finds its files; otherwise the replica's
/// default name (host and port), unique among replicas on one PostgreSQL database.
fn spill_replica_name(config: &Config) -> String {
    match config.replica.name.as_deref().map(str::trim) {
        Some(name) if !name.is_empty() => name.to_string(),
        _ if config.database.url.starts_with("sqlite:") => "local".to_string(),
        _ => config.replica.name_or_default(&config.server.bind),
    }
}

/// A name made safe as one path component (a replica's name has a colon and may have more).
fn path_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// What a saved KV cache is only valid for: the model file (its name, size, modification time
/// and a hash of its first 4 MiB, which hold the metadata and the tokenizer) and the settings
/// that change the K/V computed from it (RoPE's base and YaRN). The KV type and layout are in
/// each file's block format.
fn kv_identity(path: &std::path::Path, c: &smolchat_engine::ModelConfig) -> String {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let meta = std::fs::metadata(path).ok();
    let modified = meta
        .as_ref()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let mut head = Vec::new();
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.take(4 << 20).read_to_end(&mut head);
    }
    let hash: String = Sha256::digest(&head)
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "{}|{}|{modified}|{hash}|theta {}|yarn {:?}",
        path.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        meta.map_or(0, |m| m.len()),
        c.rope_theta,
        c.yarn
    )
}

/// Loads the model with its tokenizer and chat template (blocking: call off the event loop),
/// through the engine's one loader with the configuration's options.
pub fn load_model(
    config: &Config,
) -> Result<(Engine, Tokenizer, ChatTemplate, ModelInfo), PlatformError> {
    let path = config
        .model
        .existing_path()
        .map_err(|e| PlatformError::MissingModel(e.to_string()))?;
    let err = |source: LoadError| match source {
        // A device that cannot be used is a configuration error: name the key.
        LoadError::Engine(e @ (EngineError::Device(..) | EngineError::BadDevice { .. })) => {
            PlatformError::Device(e)
        }
        source => PlatformError::Model {
            path: path.display().to_string(),
            source,
        },
    };
    let options = config.load_options();
    let loaded = load::load(path, &options, &mut |_, _| {}).map_err(err)?;
    let template = loaded.template.map_err(|e| err(e.into()))?;
    let engine = loaded.engine;
    let cfg = &engine.config();
    let id = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| cfg.name.clone());
    let context_window = config
        .limits
        .context
        .map_or(cfg.context_length, |c| c.min(cfg.context_length));
    let info = ModelInfo {
        id,
        path: path.display().to_string(),
        architecture: cfg.arch.gguf_name().to_string(),
        context_window,
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden,
        weight_bytes: engine.weight_bytes(),
        load_s: loaded.load_s,
        device: engine.device().to_string(),
        tier: engine.tier().to_string(),
        tier_note: engine.note().map(str::to_string),
        kv_identity: kv_identity(path, cfg),
        aliases: config.model.aliases.clone(),
        answers_unknown_names: config.model.answer_unknown_names,
    };
    tracing::info!(model = %info.id, arch = %info.architecture, window = context_window, load_s = info.load_s, kv_type = %options.engine.kv.kv_type, kv_capacity_tokens = engine.kv_capacity_tokens(), device = %engine.device(), tier = %engine.tier(), "model loaded");
    Ok((engine, loaded.tokenizer, template, info))
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
        let s = &config.scheduler;
        // What the configuration leaves unset, the device decides.
        let suggested = engine.suggested();
        let on_gpu = !matches!(engine.device(), smolchat_engine::device::Device::Cpu);
        let scheduler = SchedulerActor::start(
            engine,
            Arc::clone(&tokenizer),
            SchedulerConfig {
                batcher: BatcherConfig {
                    max_running: s.max_running.unwrap_or(suggested.max_running),
                    queue_capacity: s.queue_size,
                    step_token_budget: s.batch_token_budget.unwrap_or(suggested.batch_token_budget),
                    context_window: model.context_window,
                    max_queued_per_user: s.max_queued_per_user,
                    max_running_per_user: s.max_running_per_user,
                    tokens_per_minute_per_user: config.limits.tokens_per_minute_per_user,
                    tokens_per_minute_per_group: config.limits.tokens_per_minute_per_guest_address,
                    // Set by the scheduler from the engine it starts.
                    kv_capacity_blocks: 0,
                    warm: smolchat_serving::warm::WarmConfig {
                        enabled: s.warm_drafts,
                        chunk_tokens: s.warm_chunk_tokens.max(1),
                        tokens_per_minute_per_user: s.warm_tokens_per_minute_per_user,
                    },
                },
                speculative: smolchat_serving::SpecConfig {
                    enabled: s.speculative,
                    max_draft: s.draft_max,
                    max_ngram: s.draft_ngram_max,
                    min_ngram: s.draft_ngram_min,
                    max_batch: s.draft_max_batch,
                    fixed_break_even: s.draft_break_even,
                    ngram_cache: s.draft_ngram_cache,
                    on_gpu: s.draft_on_gpu,
                },
                async_steps: s.async_steps,
                spill: (s.kv_spill_mib > 0).then(|| smolchat_serving::spill::SpillSettings {
                    dir: s
                        .kv_spill_dir
                        .as_ref()
                        .map_or_else(
                            || default_spill_dir(&config.database.url),
                            std::path::PathBuf::from,
                        )
                        .join(path_safe(&spill_replica_name(&config))),
                    budget_bytes: s.kv_spill_mib.saturating_mul(1 << 20),
                    idle: Duration::from_secs(s.kv_spill_idle_s.max(1)),
                    model: model.kv_identity.clone(),
                    ram_bytes: s
                        .kv_spill_ram_mib
                        .unwrap_or(if on_gpu { 2048 } else { 0 })
                        .saturating_mul(1 << 20) as usize,
                }),
                max_new_tokens: config.limits.max_new_tokens,
                request_timeout: (s.request_timeout_s > 0)
                    .then(|| Duration::from_secs(s.request_timeout_s)),
            },
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
        let sessions = Sessions::new(SessionShared {
            store: store.clone(),
            scheduler: scheduler.clone(),
            completions: completions.clone(),
            tokenizer: Arc::clone(&tokenizer),
            template: Arc::clone(&template),
            context_window: model.context_window,
            cfg: SessionConfig {
                max_message_chars: config.limits.max_message_chars,
                idle_timeout: Duration::from_secs(config.session.idle_timeout_s),
                disconnect_grace: Duration::from_millis(config.session.disconnect_grace_ms),
            },
            cluster: Arc::clone(&cluster),
        });
        sessions.receive_from(&cluster);
        cluster.run(scheduler.clone());
        let documents = crate::documents::DocumentReader::new(
            sandbox,
            crate::documents::longest_token_bytes(&tokenizer),
        );
        let conversations = Arc::new(Conversations::new(
            store.clone(),
            Arc::clone(&sessions),
            scheduler.clone(),
            Arc::clone(&tokenizer),
            Arc::clone(&template),
            model.context_window,
            conversations_config(&config),
            Arc::clone(&documents),
        ));
        let key = credential_key(&secret);
        let accounts = Arc::new(accounts(&config, &store, key).await?);
        let admin_auth = admin_auth(&config, &store, key);
        let admin = Admin::new(
            store.clone(),
            scheduler.clone(),
            Arc::clone(&cluster),
            Arc::clone(&conversations),
            Arc::clone(&accounts),
        );
        spawn_session_purge(store.clone());
        let audit = crate::audit::Audit::new(store.clone());
        Ok(Self {
            config,
            store,
            scheduler,
            sessions,
            cluster,
            conversations,
            completions,
            documents,
            audit,
            accounts,
            admin_auth,
            admin,
            tokenizer,
            template,
            model,
        })
    }

    /// The configuration in force (the cookie secret filled in when it was generated).
    pub fn config(&self) -> &Config {
        &self.config
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
            .read(who, name, bytes, limit, self.model.context_window)
            .await
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
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The one prompt builder over this model's template and tokenizer.
    pub fn prompt_builder(&self) -> PromptBuilder<'_> {
        PromptBuilder::new(&self.template, &self.tokenizer)
    }

    /// Whether this replica can take requests: the model thread runs and the database answers
    /// within [`DATABASE_CHECK`].
    pub async fn readiness(&self) -> Readiness {
        let model_alive =
            self.scheduler.connected() && self.scheduler.send(ModelAlive).await.unwrap_or(false);
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
        self.scheduler.send(GetStats).await.ok()
    }

    /// Sets the gauges the scheduler updates only at its steps, so an idle server reports
    /// current values too (called before `/metrics` renders).
    pub async fn refresh_gauges(&self) {
        if let Some(s) = self.stats().await {
            metrics::gauge!("smolchat_kv_bytes").set(s.kv_bytes as f64);
            metrics::gauge!("smolchat_kv_budget_bytes").set(s.kv_budget_bytes as f64);
            metrics::gauge!("smolchat_kv_evictions").set(s.evictions as f64);
            metrics::gauge!("smolchat_tokens_per_second").set(s.tokens_per_s);
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
        let m = &self.model;
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
        let spilled = tokio::time::timeout(
            SPILL_AT_STOP,
            self.scheduler.send(smolchat_serving::scheduler::SpillAll),
        )
        .await;
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

#[cfg(test)]
mod spill_tests {
    use super::*;

    /// The one rule for a request's `model`: none, the id, the file's name and the aliases are
    /// the model; the path never is; anything else only when it answers unknown names.
    #[test]
    fn a_model_answers_to_its_id_file_name_and_aliases() {
        let mut m = ModelInfo {
            id: "SmolLM2-135M-Instruct.Q4_1".into(),
            path: "/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            architecture: "llama".into(),
            context_window: 8192,
            vocab_size: 49152,
            hidden_size: 576,
            weight_bytes: 0,
            load_s: 0.0,
            device: "cpu".into(),
            tier: "cpu".into(),
            tier_note: None,
            kv_identity: String::new(),
            aliases: vec!["gpt-4o-mini".into(), "llama3".into()],
            answers_unknown_names: false,
        };
        for name in [
            "",
            "SmolLM2-135M-Instruct.Q4_1",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "gpt-4o-mini",
            "llama3",
        ] {
            assert!(m.answers_to(name), "{name}");
        }
        for name in [
            "/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "gpt-4o",
            "LLAMA3",
        ] {
            assert!(!m.answers_to(name), "{name}");
        }
        m.answers_unknown_names = true;
        assert!(m.answers_to("gpt-4o"));
        assert!(!m.is_named("gpt-4o"));
    }

    /// The spill folder sits beside a SQLite database's file and is `local` there (a restart on
    /// another port finds its files); on PostgreSQL each replica has its own.
    #[test]
    fn the_spill_folder_follows_the_database_and_the_replica() {
        assert_eq!(
            default_spill_dir("sqlite:///srv/smolchat/data/smolchat.db?mode=rwc"),
            std::path::PathBuf::from("/srv/smolchat/data/kv-spill")
        );
        assert_eq!(
            default_spill_dir("sqlite://data/smolchat.db"),
            std::path::PathBuf::from("data/kv-spill")
        );
        assert_eq!(
            default_spill_dir("postgres://db/smolchat"),
            std::path::PathBuf::from("data/kv-spill")
        );
        let mut config = Config::default();
        config.database.url = "sqlite://data/x.db".into();
        assert_eq!(spill_replica_name(&config), "local");
        config.database.url = "postgres://db/smolchat".into();
        config.server.bind = "0.0.0.0:8080".into();
        assert!(spill_replica_name(&config).ends_with(":8080"));
        config.replica.name = Some(" east-1 ".into());
        assert_eq!(spill_replica_name(&config), "east-1");
        assert_eq!(path_safe("host:8080/x"), "host_8080_x");
    }
}
