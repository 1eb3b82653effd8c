//! Wiring: loads the model and opens the store from a [`Config`], then starts the scheduler (with
//! its model thread) and the session registry. The web layer serves a [`Platform`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;

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
    pub weight_bytes: usize,
    pub load_s: f64,
}

pub struct Platform {
    pub config: Config,
    pub store: Store,
    pub scheduler: Addr<SchedulerActor>,
    pub sessions: Arc<Sessions>,
    /// This replica among those sharing the database.
    pub cluster: Arc<Cluster>,
    /// The conversation service every interface goes through.
    pub conversations: Arc<Conversations>,
    /// The completions service: every prompt any interface runs (conversations' turns and `/v1`).
    pub completions: Completions,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub model: ModelInfo,
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
        weight_bytes: engine.weight_bytes(),
        load_s: loaded.load_s,
    };
    tracing::info!(model = %info.id, arch = %info.architecture, window = context_window, load_s = info.load_s, kv_type = %options.engine.kv.kv_type, kv_capacity_tokens = engine.kv_capacity_tokens(), device = %engine.device(), "model loaded");
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
            if let Some(dir) = store.data_dir() {
                config.server.cookie_secret = Some(crate::secrets::load_or_create(
                    dir,
                    crate::secrets::COOKIE_SECRET_FILE,
                )?);
            }
        }
        let r = &config.replica;
        let (cluster, interrupted) = Cluster::join(
            store.clone(),
            ClusterConfig {
                name: r.name_or_default(&config.server.bind),
                url: r.url_or_default(&config.server.bind),
                heartbeat: r.heartbeat(),
                lease: r.lease(),
                affinity: r.affinity,
                bus_key: config
                    .server
                    .cookie_secret
                    .clone()
                    .unwrap_or_default()
                    .into_bytes(),
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
        let tokenizer = Arc::new(tokenizer);
        let template = Arc::new(template);
        let s = &config.scheduler;
        let scheduler = SchedulerActor::start(
            engine,
            Arc::clone(&tokenizer),
            SchedulerConfig {
                batcher: BatcherConfig {
                    max_running: s.max_running,
                    queue_capacity: s.queue_size,
                    step_token_budget: s.batch_token_budget,
                    context_window: model.context_window,
                    max_queued_per_user: s.max_queued_per_user,
                    max_running_per_user: s.max_running_per_user,
                    tokens_per_minute_per_user: config.limits.tokens_per_minute_per_user,
                    tokens_per_minute_per_group: config.limits.tokens_per_minute_per_guest_address,
                    // Set by the scheduler from the engine it starts.
                    kv_capacity_blocks: 0,
                },
                kv_budget_bytes: s.kv_budget_mib << 20,
                max_new_tokens: config.limits.max_new_tokens,
                request_timeout: (s.request_timeout_s > 0)
                    .then(|| Duration::from_secs(s.request_timeout_s)),
            },
        );
        let completions = Completions::new(scheduler.clone(), store.clone(), model.context_window);
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
        let conversations = Arc::new(Conversations::new(
            store.clone(),
            Arc::clone(&sessions),
            scheduler.clone(),
            Arc::clone(&tokenizer),
            Arc::clone(&template),
            model.context_window,
            conversations_config(&config),
        ));
        Ok(Self {
            config,
            store,
            scheduler,
            sessions,
            cluster,
            conversations,
            completions,
            tokenizer,
            template,
            model,
        })
    }
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
    }
}

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
