//! Loading a model: the file opened through the engine's one loader, the facts the interfaces
//! show ([`ModelInfo`]), and its scheduler started with the configuration's settings. The main
//! model at start-up and every other model on demand ([`super::Models`]) load here.

use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use smolchat_engine::{Engine, EngineError};
use smolchat_serving::batcher::{BatcherConfig, TokenMeter};
use smolchat_serving::load::{self, LoadError};
use smolchat_serving::{SchedulerActor, SchedulerConfig};
use smolchat_text::template::ChatTemplate;
use smolchat_text::tokenizer::Tokenizer;

use crate::config::Config;

/// Why a model could not be loaded, naming its file.
#[derive(Debug, thiserror::Error)]
pub enum LoadModelError {
    #[error("model {path}: {source}")]
    Model {
        path: String,
        #[source]
        source: LoadError,
    },
    #[error("{0}")]
    MissingModel(String),
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
) -> Result<(Engine, Tokenizer, ChatTemplate, ModelInfo), LoadModelError> {
    let path = config
        .model
        .existing_path()
        .map_err(|e| LoadModelError::MissingModel(e.to_string()))?;
    let err = |source: LoadError| match source {
        // A device that cannot be used is a configuration error: name the key.
        LoadError::Engine(e @ (EngineError::Device(..) | EngineError::BadDevice { .. })) => {
            LoadModelError::Device(e)
        }
        source => LoadModelError::Model {
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
    };
    tracing::info!(model = %info.id, arch = %info.architecture, window = context_window, load_s = info.load_s, kv_type = %options.engine.kv.kv_type, kv_capacity_tokens = engine.kv_capacity_tokens(), device = %engine.device(), tier = %engine.tier(), "model loaded");
    Ok((engine, loaded.tokenizer, template, info))
}

/// Starts the scheduler actor (and its model thread) for a loaded model, with `[scheduler]`'s
/// settings and what the device suggests for those it leaves unset. `spill_model`: `None` for
/// the main model (its spill folder is the replica's, as before there were several models),
/// the model's id for another (a folder of its own, beside it).
pub(crate) fn start_scheduler(
    config: &Config,
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    model: &ModelInfo,
    meter: &TokenMeter,
    spill_model: Option<&str>,
) -> Addr<SchedulerActor> {
    let s = &config.scheduler;
    // What the configuration leaves unset, the device decides.
    let suggested = engine.suggested();
    let on_gpu = !matches!(engine.device(), smolchat_engine::device::Device::Cpu);
    SchedulerActor::start(
        engine,
        tokenizer,
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
            spill: spill_dir(config, spill_model).map(|dir| {
                smolchat_serving::spill::SpillSettings {
                    dir,
                    budget_bytes: s.kv_spill_mib.saturating_mul(1 << 20),
                    idle: Duration::from_secs(s.kv_spill_idle_s.max(1)),
                    model: model.kv_identity.clone(),
                    ram_bytes: s
                        .kv_spill_ram_mib
                        .unwrap_or(if on_gpu { 2048 } else { 0 })
                        .saturating_mul(1 << 20) as usize,
                }
            }),
            tokens: meter.clone(),
            model: model.id.clone(),
            max_new_tokens: config.limits.max_new_tokens,
            request_timeout: (s.request_timeout_s > 0)
                .then(|| Duration::from_secs(s.request_timeout_s)),
        },
    )
}

/// What a loaded model takes in memory: its weights and its KV cache's budget.
pub(crate) fn model_memory_bytes(engine: &Engine) -> u64 {
    (engine.weight_bytes() as u64).saturating_add(
        (engine.kv_capacity_blocks() as u64).saturating_mul(engine.kv_block_bytes() as u64),
    )
}

/// This replica's spill folder for a model (`None`: the spill tier is off); see
/// [`spill_folder`].
pub(crate) fn spill_dir(config: &Config, spill_model: Option<&str>) -> Option<std::path::PathBuf> {
    let s = &config.scheduler;
    (s.kv_spill_mib > 0).then(|| {
        s.kv_spill_dir
            .as_ref()
            .map_or_else(
                || default_spill_dir(&config.database.url),
                std::path::PathBuf::from,
            )
            .join(spill_folder(config, spill_model))
    })
}

/// This replica's spill folder for a model: the replica's own for the main model, a sibling
/// named after the model for another (each folder holds one model's caches: the tier drops
/// files of another model when it opens).
fn spill_folder(config: &Config, model: Option<&str>) -> String {
    let replica = path_safe(&spill_replica_name(config));
    match model {
        None => replica,
        Some(id) => format!("{replica}--{}", path_safe(id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
