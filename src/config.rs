//! Configuration: built-in defaults, then `config/default.toml`, then an optional config file,
//! then `SMOLCHAT_…` environment variables (sections split by `__`, e.g.
//! `SMOLCHAT_SERVER__BIND=0.0.0.0:8080`), then command-line flags (applied by the CLI).

use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Invalid(String),
    #[error("configuration file {0} does not exist")]
    MissingFile(PathBuf),
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub server: ServerConfig,
    pub database: DatabaseConfig,
    pub scheduler: SchedulerSection,
    pub limits: LimitsConfig,
    pub session: SessionSection,
    /// Defaults for new conversations.
    pub sampling: SamplingDefaults,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The GGUF file. Default: the embedded SmolLM2-135M-Instruct under `models/`.
    pub path: PathBuf,
    /// Optional `tokenizer.json` overriding the GGUF's tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// `auto`, `cpu`, `cuda:N` or `metal`.
    pub device: String,
    /// Compute threads (default: all cores).
    pub threads: Option<usize>,
    /// YaRN context extension factor (SmolLM3: 2 extends its 64k training context to 128k).
    /// Unset: whatever the GGUF says (usually no scaling).
    pub yarn_factor: Option<f32>,
    /// The context the model was trained on, for YaRN (default: the GGUF's context length).
    pub yarn_original_context: Option<usize>,
    /// How the KV cache stores keys and values: `f32`, `f16` (default) or `q8_0` (about half of
    /// f16's bytes; needs a head dimension that is a multiple of 32).
    pub kv_type: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    pub bind: String,
    /// Token for `/admin`; the admin page is disabled without one.
    pub admin_token: Option<String>,
    /// Bearer key for `/v1/…`; open when unset.
    pub api_key: Option<String>,
    /// Secret for signing cookies (at least 64 bytes once decoded; generated per start when
    /// unset, which logs everyone out on restart).
    pub cookie_secret: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    pub url: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSection {
    /// KV cache budget in MiB across all sequences.
    pub kv_budget_mib: usize,
    /// Tokens per step (decode tokens plus prefill chunks).
    pub batch_token_budget: usize,
    pub max_running: usize,
    /// Requests allowed to wait; beyond this, 503 with Retry-After.
    pub queue_size: usize,
    /// Wall-clock limit per request, in seconds (0: none).
    pub request_timeout_s: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Context window to use (default and upper bound: the model's).
    pub context: Option<usize>,
    /// Upper bound on new tokens per reply.
    pub max_new_tokens: usize,
    /// Longest accepted user message, in characters.
    pub max_message_chars: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SessionSection {
    /// Seconds before an idle session actor stops.
    pub idle_timeout_s: u64,
    /// Milliseconds a reply keeps running after its last viewer left (a reload reconnects).
    pub disconnect_grace_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub max_tokens: usize,
    pub thinking: bool,
    pub system_prompt: Option<String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from(crate::cli::DEFAULT_MODEL),
            tokenizer: None,
            device: "auto".into(),
            threads: None,
            yarn_factor: None,
            yarn_original_context: None,
            kv_type: "f16".into(),
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:8080".into(),
            admin_token: None,
            api_key: None,
            cookie_secret: None,
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://data/smolchat.db".into(),
        }
    }
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self {
            kv_budget_mib: 2048,
            batch_token_budget: 512,
            max_running: 16,
            queue_size: 64,
            request_timeout_s: 600,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            context: None,
            max_new_tokens: 4096,
            max_message_chars: 32_000,
        }
    }
}

impl Default for SessionSection {
    fn default() -> Self {
        Self {
            idle_timeout_s: 300,
            disconnect_grace_ms: 5_000,
        }
    }
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        Self {
            temperature: 0.7,
            top_p: 0.95,
            top_k: 40,
            max_tokens: 1024,
            thinking: true,
            system_prompt: None,
        }
    }
}

impl Config {
    /// Defaults ← `config/default.toml` (when present) ← `file` ← `SMOLCHAT_…` variables.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        let default_file = Path::new("config/default.toml");
        if default_file.exists() {
            fig = fig.merge(Toml::file(default_file));
        }
        if let Some(f) = file {
            if !f.exists() {
                return Err(ConfigError::MissingFile(f.to_path_buf()));
            }
            fig = fig.merge(Toml::file(f));
        }
        fig = fig.merge(
            Env::prefixed("SMOLCHAT_")
                .split("__")
                .ignore(&["log", "threads", "model", "config"]),
        );
        let cfg: Config = fig
            .extract()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// `model.kv_type`, parsed.
    pub fn kv_type(&self) -> Result<crate::engine::KvType, String> {
        self.model
            .kv_type
            .parse()
            .map_err(|e: String| format!("model.kv_type: {e}"))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if let Err(e) = self.kv_type() {
            return bad(e);
        }
        let s = &self.scheduler;
        if s.max_running == 0 {
            return bad("scheduler.max_running must be at least 1".into());
        }
        if s.batch_token_budget == 0 {
            return bad("scheduler.batch_token_budget must be at least 1".into());
        }
        if s.kv_budget_mib == 0 {
            return bad("scheduler.kv_budget_mib must be at least 1".into());
        }
        if self.limits.max_new_tokens == 0 || self.limits.max_message_chars == 0 {
            return bad(
                "limits.max_new_tokens and limits.max_message_chars must be at least 1".into(),
            );
        }
        if let Some(f) = self.model.yarn_factor {
            if !(f.is_finite() && f >= 1.0) {
                return bad(format!("model.yarn_factor must be at least 1, got {f}"));
            }
        }
        if !matches!(self.model.device.as_str(), "auto" | "cpu" | "metal")
            && !self.model.device.starts_with("cuda")
        {
            return bad(format!(
                "model.device `{}` is not one of auto, cpu, cuda:N, metal",
                self.model.device
            ));
        }
        Ok(())
    }
}
