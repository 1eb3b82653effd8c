//! The models a server serves: the main one (`[model]`, loaded at start and always loaded) and
//! those of `[[models.entries]]`, each loaded when a request names it and unloaded when it has
//! been idle for its keep-alive or to make room within `models.memory_budget_mib`. Each loaded
//! model has its own scheduler and model thread ([`ServedModel`]); every interface finds a
//! model by the name a client sent through [`Models::resolve`], the one rule for model names.
//!
//! A model is never unloaded under a request: it is unloaded only when nothing but the registry
//! holds its [`ServedModel`] (a request in flight holds it through its
//! [`Completion`](crate::completions::Completion)) and its scheduler agrees it is idle
//! ([`Retire`]).

pub mod load;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::Addr;
use smolchat_serving::batcher::TokenMeter;
use smolchat_serving::scheduler::{Cancel, GetStats, Retire};
use smolchat_serving::{SchedulerActor, SchedulerStats};
use smolchat_text::prompt::PromptBuilder;
use smolchat_text::template::ChatTemplate;
use smolchat_text::tokenizer::Tokenizer;

use crate::completions::{Completion, CompletionRequest, Completions, SubmitError};
use crate::config::{Config, ModelEntry};
pub use load::{load_model, LoadModelError, ModelInfo};

/// A loaded model: its facts, its text side and the scheduler that runs it.
pub struct ServedModel {
    info: ModelInfo,
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    scheduler: Addr<SchedulerActor>,
    completions: Completions,
    /// Whether its chat template has a thinking switch (`enable_thinking`).
    can_think: bool,
    /// Its weights and KV budget, counted against `models.memory_budget_mib`.
    memory_bytes: u64,
}

impl ServedModel {
    pub(crate) fn new(
        info: ModelInfo,
        tokenizer: Arc<Tokenizer>,
        template: Arc<ChatTemplate>,
        scheduler: Addr<SchedulerActor>,
        completions: Completions,
        memory_bytes: u64,
        may_think: Option<bool>,
    ) -> Self {
        let can_think = may_think_with(template.source(), may_think);
        Self {
            info,
            tokenizer,
            template,
            scheduler,
            completions,
            can_think,
            memory_bytes,
        }
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn id(&self) -> &str {
        &self.info.id
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

    /// Whether it may think: its chat template has the switch and its entry does not keep it off.
    pub fn can_think(&self) -> bool {
        self.can_think
    }

    /// Whether its template could think but its entry keeps it off (`thinking = false`): its
    /// prompts then ask for `enable_thinking = false`, whatever a request says.
    pub fn thinking_kept_off(&self) -> bool {
        !self.can_think && template_can_think(self.template.source())
    }

    /// The completions service of this model (embeddings, and what needs no hold on it).
    pub fn completions(&self) -> &Completions {
        &self.completions
    }

    pub(crate) fn scheduler(&self) -> &Addr<SchedulerActor> {
        &self.scheduler
    }

    pub(crate) fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.tokenizer)
    }

    pub(crate) fn template_arc(&self) -> Arc<ChatTemplate> {
        Arc::clone(&self.template)
    }

    /// Queues a request on this model. The completion holds the model: it is not unloaded
    /// before the request ends.
    pub async fn submit(
        self: &Arc<Self>,
        request: CompletionRequest,
    ) -> Result<Completion, SubmitError> {
        let completion = self.completions.submit(request).await?;
        Ok(completion.holding(Arc::clone(self) as Arc<dyn std::any::Any + Send + Sync>))
    }

    /// Stops a request of this model (it ends at the next step).
    pub fn cancel(&self, id: crate::completions::RequestId) {
        self.scheduler.do_send(Cancel(id));
    }

    /// Asks for a conversation's spilled KV cache to be read ahead (it may come back soon).
    pub fn prefetch(&self, conversation: uuid::Uuid) {
        self.scheduler
            .do_send(smolchat_serving::scheduler::Prefetch(conversation));
    }

    /// Offers a typed draft to warm on this model (see `smolchat_serving::warm`).
    pub(crate) async fn warm(
        &self,
        draft: smolchat_serving::warm::Draft,
    ) -> Result<Result<(), smolchat_serving::warm::WarmRefused>, actix::MailboxError> {
        self.scheduler
            .send(smolchat_serving::scheduler::Warm(draft))
            .await
    }

    /// The scheduler's counters; `None` once its thread is gone.
    pub async fn stats(&self) -> Option<SchedulerStats> {
        self.scheduler.send(GetStats).await.ok()
    }
}

/// Whether a chat template has a thinking switch: it reads `enable_thinking` (SmolLM3, Qwen3).
pub fn template_can_think(source: &str) -> bool {
    source.contains("enable_thinking")
}

/// Whether a model may think: its template has the switch and its entry's `thinking` is not
/// `false`.
fn may_think_with(template_source: &str, may_think: Option<bool>) -> bool {
    may_think != Some(false) && template_can_think(template_source)
}

/// Why a model cannot be had.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    #[error("the model {name:?} does not exist on this server; it serves {available}")]
    NotFound { name: String, available: String },
    #[error("the model {id:?} could not be loaded: {message}")]
    Load { id: String, message: String },
    #[error("the model {id:?} needs {needed_mib} MiB but models.memory_budget_mib is {budget_mib} MiB and {busy} busy with replies; retry when they finish, or raise the budget")]
    NoRoom {
        id: String,
        needed_mib: u64,
        budget_mib: u64,
        busy: String,
    },
    #[error("the model {id:?} is busy (requests are queued or running on it); unload it when they finish")]
    Busy { id: String },
    #[error("the main model {id:?} is always loaded; it cannot be unloaded")]
    Pinned { id: String },
}

/// What the registry knows of a configured model, loaded or not.
#[derive(Debug, Clone)]
pub struct ModelStatus {
    pub id: String,
    pub aliases: Vec<String>,
    pub path: String,
    /// The main model (always loaded).
    pub main: bool,
    /// The model new conversations use.
    pub default: bool,
    pub state: LoadState,
    /// Its weights and KV budget while loaded; the file's size otherwise.
    pub memory_bytes: u64,
    /// When it was last asked for (loaded or used).
    pub idle_s: Option<f64>,
    /// How long it stays loaded when idle; `None`: until unloaded for room or by an admin.
    pub keep_alive: Option<Duration>,
    /// Seconds its last load took.
    pub load_s: Option<f64>,
    pub loads: u64,
    pub unloads: u64,
    /// Why its last load failed.
    pub last_error: Option<String>,
    /// The loaded model's facts.
    pub info: Option<ModelInfo>,
    /// Whether its template can think (known once loaded).
    pub can_think: Option<bool>,
    /// The SHA-256 of its file as first loaded (hex; computed off the load's path, so absent
    /// for a moment after the first load).
    pub sha256: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadState {
    Loaded,
    Loading,
    Unloaded,
}

impl LoadState {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadState::Loaded => "loaded",
            LoadState::Loading => "loading",
            LoadState::Unloaded => "not loaded",
        }
    }
}

/// A configured model's names (known before it is loaded) and its registry state.
struct Slot {
    id: String,
    path: std::path::PathBuf,
    aliases: Vec<String>,
    /// `None` for the main model (never unloaded).
    entry: Option<ModelEntry>,
    loaded: Option<Arc<ServedModel>>,
    loading: bool,
    last_used: Instant,
    load_s: Option<f64>,
    loads: u64,
    unloads: u64,
    last_error: Option<String>,
    /// Whether its template can think, read from its file once (without loading it).
    can_think: Option<bool>,
    /// Its file's SHA-256 when it was first loaded (filled by a thread of its own).
    sha256: Arc<std::sync::OnceLock<String>>,
}

impl Slot {
    /// A model's slot, not loaded (`entry`: `None` for the main model).
    fn new(
        id: &str,
        path: std::path::PathBuf,
        aliases: &[String],
        entry: Option<ModelEntry>,
    ) -> Self {
        Slot {
            id: id.to_string(),
            path,
            aliases: aliases.to_vec(),
            entry,
            loaded: None,
            loading: false,
            last_used: Instant::now(),
            load_s: None,
            loads: 0,
            unloads: 0,
            last_error: None,
            can_think: None,
            sha256: Arc::default(),
        }
    }

    /// Whether `name` is this model: its id, an alias or its file's name (never the path,
    /// which would let a client probe the server's disk).
    fn is_named(&self, name: &str) -> bool {
        name == self.id
            || self.aliases.iter().any(|a| a == name)
            || self
                .path
                .file_name()
                .is_some_and(|f| f.to_string_lossy() == name)
    }
}

/// How long a request waits for room in the memory budget (other models' replies to finish)
/// before it is refused.
const ROOM_WAIT: Duration = Duration::from_secs(120);

/// The registry (see the module docs).
pub struct Models {
    config: Config,
    slots: Mutex<Vec<Slot>>,
    /// One load or unload at a time: the budget's arithmetic is then never raced.
    changing: tokio::sync::Mutex<()>,
    budget_bytes: Option<u64>,
    answers_unknown_names: bool,
    /// Index of the model new conversations (and requests naming none) use; an admin may
    /// change it while the server runs.
    default: std::sync::atomic::AtomicUsize,
    /// Shared by every model's scheduler (a user's tokens count once, whatever model).
    meter: TokenMeter,
    /// Where schedulers are started: the system's arbiter, so a model loaded by a request
    /// outlives the HTTP worker that asked.
    arbiter: actix::ArbiterHandle,
    /// The completions service of the main model; others are its clones over their scheduler.
    completions: Completions,
    /// The model that writes titles (`models.task`), if any.
    task: Option<String>,
    /// The main model, also in the first slot (never unloaded).
    main: Arc<ServedModel>,
}

/// See [`Models::estimate_bytes`].
fn estimate_bytes(config: &Config, entry: &ModelEntry) -> u64 {
    use smolchat_engine::device::{DeviceRequest, Suggested};
    let file = std::fs::metadata(&entry.path).map_or(0, |m| m.len());
    let on_gpu = matches!(
        entry.device.unwrap_or(config.model.device),
        DeviceRequest::Cuda(_)
    );
    let kv = entry
        .kv_budget_mib
        .or(config.scheduler.kv_budget_mib)
        .map(|mib| (mib as u64) << 20)
        .unwrap_or(if on_gpu {
            0
        } else {
            Suggested::CPU.kv_budget_bytes as u64
        });
    file.saturating_add(kv)
}

/// Hashes a model's file on a thread of its own (a large file takes seconds; the load does not
/// wait): the first hash is recorded in `first`; a later one that differs is logged, since the
/// file was replaced while the server ran (saved KV caches of it are already refused by their
/// identity).
fn record_sha256(id: &str, path: &std::path::Path, first: &Arc<std::sync::OnceLock<String>>) {
    let (id, path, first) = (id.to_string(), path.to_path_buf(), Arc::clone(first));
    let spawned = std::thread::Builder::new()
        .name("smolchat-sha256".into())
        .spawn(move || {
            use sha2::{Digest, Sha256};
            use std::io::Read;
            let mut hasher = Sha256::new();
            let Ok(mut file) = std::fs::File::open(&path) else {
                return;
            };
            let mut buf = vec![0u8; 1 << 20];
            loop {
                match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => hasher.update(&buf[..n]),
                    Err(e) => {
                        tracing::warn!(model = %id, path = %path.display(), "cannot hash the model's file: {e}");
                        return;
                    }
                }
            }
            let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
            match first.get() {
                None => {
                    tracing::info!(model = %id, sha256 = %hex, "model file hashed");
                    let _ = first.set(hex);
                }
                Some(was) if *was != hex => tracing::warn!(
                    model = %id,
                    path = %path.display(),
                    first = %was,
                    now = %hex,
                    "the model's file changed since it was first loaded"
                ),
                Some(_) => {}
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the hashing thread: {e}");
    }
}

/// With `models.task = "auto"`: the embedded SmolLM2-135M as a model of its own, for the
/// chores, when the main model is another file and SmolLM2's is there (and no entry serves it
/// already).
fn implicit_task_entry(config: &Config) -> Option<ModelEntry> {
    let small = std::path::Path::new(crate::config::DEFAULT_MODEL);
    let same_file = |p: &std::path::Path| p.file_name() == small.file_name();
    let wanted = config.models.task.trim() == "auto"
        && !same_file(&config.model.path)
        && small.exists()
        && !config.models.entries.iter().any(|e| same_file(&e.path));
    wanted.then(|| ModelEntry {
        id: small
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into_owned()),
        path: small.to_path_buf(),
        ..ModelEntry::default()
    })
}

impl Models {
    /// The registry around the loaded main model. Must run inside an actix system.
    pub(crate) fn new(
        config: &Config,
        main: Arc<ServedModel>,
        meter: TokenMeter,
        completions: Completions,
    ) -> Arc<Self> {
        let main_model = Arc::clone(&main);
        let mut first = Slot::new(
            &main.info.id,
            std::path::PathBuf::from(&main.info.path),
            &main.info.aliases,
            None,
        );
        first.load_s = Some(main.info.load_s);
        first.loads = 1;
        first.loaded = Some(main);
        let mut slots = vec![first];
        record_sha256(&slots[0].id, &slots[0].path, &slots[0].sha256);
        let mut entries = config.models.entries.clone();
        if let Some(implicit) = implicit_task_entry(config) {
            entries.push(implicit);
        }
        for e in entries {
            slots.push(Slot::new(
                &e.id,
                e.path.clone(),
                &e.aliases,
                Some(e.clone()),
            ));
        }
        let default = slots
            .iter()
            .position(|s| s.id == config.models.default)
            .unwrap_or(0);
        let task = match config.models.task.trim() {
            "" | "off" => None,
            "auto" => slots
                .iter()
                .skip(1)
                .find(|s| {
                    s.path.file_name()
                        == std::path::Path::new(crate::config::DEFAULT_MODEL).file_name()
                })
                .map(|s| s.id.clone()),
            name => slots
                .iter()
                .find(|s| s.is_named(name))
                .map(|s| s.id.clone()),
        };
        let models = Arc::new(Self {
            config: config.clone(),
            slots: Mutex::new(slots),
            changing: tokio::sync::Mutex::new(()),
            budget_bytes: (config.models.memory_budget_mib > 0)
                .then(|| config.models.memory_budget_mib.saturating_mul(1 << 20)),
            answers_unknown_names: config.model.answer_unknown_names,
            default: std::sync::atomic::AtomicUsize::new(default),
            meter,
            arbiter: actix::System::current().arbiter().clone(),
            task,
            main: main_model,
            completions,
        });
        models.spawn_keep_alive();
        for e in config.models.entries.iter().filter(|e| e.preload) {
            let (models, id) = (Arc::clone(&models), e.id.clone());
            actix::spawn(async move {
                if let Err(e) = models.load(&id).await {
                    tracing::warn!("cannot preload a model: {e}");
                }
            });
        }
        models
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The main model (always loaded).
    pub fn main(&self) -> Arc<ServedModel> {
        Arc::clone(&self.main)
    }

    fn default_index(&self) -> usize {
        self.default.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Makes `name`'s model the default (until the server restarts: `models.default` says
    /// which one it starts with).
    pub fn set_default(&self, name: &str) -> Result<String, ModelError> {
        let id = self.find(name)?;
        let i = self
            .slots()
            .iter()
            .position(|s| s.id == id)
            .ok_or_else(|| ModelError::NotFound {
                name: name.to_string(),
                available: String::new(),
            })?;
        self.default.store(i, std::sync::atomic::Ordering::Release);
        tracing::info!(model = %id, "the default model changed");
        Ok(id)
    }

    /// The model that writes titles (`models.task`), if any.
    pub fn task_id(&self) -> Option<String> {
        self.task.clone()
    }

    /// The default sampling of the model `name` means (temperature, top-p, top-k): its entry's
    /// where it sets them, `[sampling]`'s otherwise (an unknown name: `[sampling]`'s).
    pub fn sampling_defaults(&self, name: &str) -> (f32, f32, usize) {
        let s = &self.config.sampling;
        let base = (s.temperature, s.top_p, s.top_k);
        let Ok(id) = self.find(name) else {
            return base;
        };
        let slots = self.slots();
        match slots
            .iter()
            .find(|s| s.id == id)
            .and_then(|s| s.entry.as_ref())
        {
            Some(e) => (
                e.temperature.unwrap_or(base.0),
                e.top_p.unwrap_or(base.1),
                e.top_k.unwrap_or(base.2),
            ),
            None => base,
        }
    }

    /// Whether the task model suggests follow-up questions after each reply
    /// (`models.follow_ups`).
    pub fn follow_ups(&self) -> bool {
        self.config.models.follow_ups
    }

    /// The id of the model new conversations use.
    pub fn default_id(&self) -> String {
        self.slots()[self.default_index()].id.clone()
    }

    /// The id of the model `name` means, without loading it: none or an empty name is the
    /// default model (lenient, like llama-server); a model's id, alias or file name is that
    /// model; any other name is the default model when `model.answer_unknown_names` is set,
    /// and `NotFound` otherwise. The one rule for a request's model name.
    pub fn find(&self, name: &str) -> Result<String, ModelError> {
        if name.is_empty() {
            return Ok(self.default_id());
        }
        match self.find_named(name) {
            Err(_) if self.answers_unknown_names => Ok(self.default_id()),
            found => found,
        }
    }

    /// The id of the model whose own name (id, alias, file name) `name` is: what a setting
    /// names, unlike [`Models::find`], which may answer any name.
    pub fn find_named(&self, name: &str) -> Result<String, ModelError> {
        let slots = self.slots();
        match slots.iter().find(|s| s.is_named(name)) {
            Some(s) => Ok(s.id.clone()),
            None => Err(ModelError::NotFound {
                name: name.to_string(),
                available: slots
                    .iter()
                    .map(|s| format!("{:?}", s.id))
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// The model `name` means (see [`Models::find`]), loaded first when it is not: the
    /// request waits while it loads.
    pub async fn resolve(&self, name: &str) -> Result<Arc<ServedModel>, ModelError> {
        let id = self.find(name)?;
        self.load(&id).await
    }

    /// The model `id` if it is loaded now, without counting it as used (a read-ahead or a
    /// draft does not keep a model loaded).
    pub fn peek(&self, id: &str) -> Option<Arc<ServedModel>> {
        self.slots()
            .iter()
            .find(|s| s.id == id)
            .and_then(|s| s.loaded.clone())
    }

    /// The model `id` if it is loaded now, counted as used (nothing is loaded for the asking).
    pub fn loaded(&self, id: &str) -> Option<Arc<ServedModel>> {
        let mut slots = self.slots();
        let s = slots.iter_mut().find(|s| s.id == id)?;
        s.last_used = Instant::now();
        s.loaded.clone()
    }

    /// The model of a conversation: the one it names when that is still configured, else the
    /// default one (a model removed from the configuration does not strand its conversations).
    pub async fn for_conversation(
        &self,
        model: Option<&str>,
    ) -> Result<Arc<ServedModel>, ModelError> {
        let id = model
            .filter(|m| self.slots().iter().any(|s| s.id == *m))
            .map_or_else(|| self.default_id(), str::to_string);
        self.load(&id).await
    }

    /// Whether model `id`'s chat template can switch thinking on and off: the loaded model's,
    /// or read from its file's metadata (once; a file that cannot be read cannot think).
    pub fn can_think(&self, id: &str) -> bool {
        let (loaded, known, path, may) = {
            let slots = self.slots();
            let Some(s) = slots.iter().find(|s| s.id == id) else {
                return false;
            };
            let may = s.entry.as_ref().and_then(|e| e.thinking);
            (s.loaded.clone(), s.can_think, s.path.clone(), may)
        };
        if let Some(m) = loaded {
            return m.can_think;
        }
        if let Some(known) = known {
            return known;
        }
        let think = smolchat_gguf::GgufSource::open(&path)
            .ok()
            .and_then(|g| ChatTemplate::from_gguf(&g).ok())
            .is_some_and(|t| may_think_with(t.source(), may));
        self.set(id, |s| s.can_think = Some(think));
        think
    }

    /// Every configured model's state.
    pub fn list(&self) -> Vec<ModelStatus> {
        let slots = self.slots();
        slots
            .iter()
            .enumerate()
            .map(|(i, s)| ModelStatus {
                id: s.id.clone(),
                aliases: s.aliases.clone(),
                path: s.path.display().to_string(),
                main: s.entry.is_none(),
                default: i == self.default_index(),
                state: if s.loaded.is_some() {
                    LoadState::Loaded
                } else if s.loading {
                    LoadState::Loading
                } else {
                    LoadState::Unloaded
                },
                memory_bytes: s.loaded.as_ref().map_or_else(
                    || std::fs::metadata(&s.path).map_or(0, |m| m.len()),
                    |m| m.memory_bytes,
                ),
                idle_s: Some(s.last_used.elapsed().as_secs_f64()),
                keep_alive: self.keep_alive(s),
                load_s: s.load_s,
                loads: s.loads,
                unloads: s.unloads,
                last_error: s.last_error.clone(),
                info: s.loaded.as_ref().map(|m| m.info.clone()),
                can_think: s.loaded.as_ref().map(|m| m.can_think),
                sha256: s.sha256.get().cloned(),
            })
            .collect()
    }

    /// Every loaded model.
    pub fn all_loaded(&self) -> Vec<Arc<ServedModel>> {
        self.slots()
            .iter()
            .filter_map(|s| s.loaded.clone())
            .collect()
    }

    /// Loads the model `id` (a configured id) if it is not loaded, making room within the
    /// budget by unloading the least recently used idle models; waits up to [`ROOM_WAIT`]
    /// for room held by models with replies running.
    pub async fn load(&self, id: &str) -> Result<Arc<ServedModel>, ModelError> {
        if let Some(m) = self.loaded(id) {
            return Ok(m);
        }
        let deadline = Instant::now() + ROOM_WAIT;
        let mut told = false;
        loop {
            let changing = self.changing.lock().await;
            // Loaded while this request waited for the lock (by the request before it).
            if let Some(m) = self.loaded(id) {
                return Ok(m);
            }
            let entry = {
                let slots = self.slots();
                let s = slots
                    .iter()
                    .find(|s| s.id == id)
                    .ok_or_else(|| ModelError::NotFound {
                        name: id.to_string(),
                        available: String::new(),
                    })?;
                s.entry.clone()
            };
            let Some(entry) = entry else {
                return Err(ModelError::Load {
                    id: id.to_string(),
                    message: "the main model is not loaded".into(),
                });
            };
            let needed = self.estimate_bytes(&entry);
            match self.make_room(id, needed).await {
                Ok(()) => {}
                Err(busy) if Instant::now() < deadline => {
                    drop(changing);
                    if !told {
                        told = true;
                        tracing::info!(model = id, busy, "a request waits for room in models.memory_budget_mib to load its model");
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
                Err(busy) => {
                    return Err(ModelError::NoRoom {
                        id: id.to_string(),
                        needed_mib: needed >> 20,
                        budget_mib: self.budget_bytes.unwrap_or(0) >> 20,
                        busy,
                    })
                }
            }
            return self.load_now(&entry).await;
        }
    }

    /// What loading `entry` will take: its file (the weights) and its KV budget: the one set,
    /// else the CPU's default (2 GiB) unless it goes to a GPU, whose default depends on the
    /// memory free there and is counted once loaded.
    fn estimate_bytes(&self, entry: &ModelEntry) -> u64 {
        estimate_bytes(&self.config, entry)
    }

    /// Unloads idle models, least recently used first, until `needed` more bytes fit the
    /// budget. `Err` names the models holding the room with requests when they cannot.
    async fn make_room(&self, for_id: &str, needed: u64) -> Result<(), String> {
        let Some(budget) = self.budget_bytes else {
            return Ok(());
        };
        loop {
            let (used, candidate, busy) = {
                let slots = self.slots();
                let used: u64 = slots
                    .iter()
                    .filter_map(|s| s.loaded.as_ref())
                    .map(|m| m.memory_bytes)
                    .sum();
                // Unloadable: loaded, not the main model, not the one asked for, and held by
                // nothing but this registry (no request in flight holds it).
                let mut idle: Vec<&Slot> = slots
                    .iter()
                    .filter(|s| s.entry.is_some() && s.id != for_id)
                    .filter(|s| s.loaded.as_ref().is_some_and(|m| Arc::strong_count(m) == 1))
                    .collect();
                idle.sort_by_key(|s| s.last_used);
                let busy: Vec<String> = slots
                    .iter()
                    .filter(|s| s.entry.is_some())
                    .filter(|s| s.loaded.as_ref().is_some_and(|m| Arc::strong_count(m) > 1))
                    .map(|s| s.id.clone())
                    .collect();
                (used, idle.first().map(|s| s.id.clone()), busy)
            };
            if used.saturating_add(needed) <= budget {
                return Ok(());
            }
            let Some(victim) = candidate else {
                let held = if busy.is_empty() {
                    "the main model alone leaves too little".to_string()
                } else {
                    format!("{} are", busy.join(", "))
                };
                return Err(held);
            };
            tracing::info!(
                model = %victim,
                for_model = for_id,
                "unloading the least recently used idle model to make room"
            );
            // A model that turned busy meanwhile stays; the loop looks again.
            let _ = self.retire(&victim).await;
        }
    }

    /// Unloads `id` if it is idle: its scheduler retires (refusing when requests are queued
    /// or running), its thread ends and its memory is freed. `Ok(false)`: it was not loaded.
    async fn retire(&self, id: &str) -> Result<bool, ModelError> {
        let model = {
            let slots = self.slots();
            let s = slots.iter().find(|s| s.id == id);
            match s {
                None => return Ok(false),
                Some(s) if s.entry.is_none() => {
                    return Err(ModelError::Pinned { id: id.to_string() })
                }
                Some(s) => match &s.loaded {
                    None => return Ok(false),
                    Some(m) if Arc::strong_count(m) > 1 => {
                        return Err(ModelError::Busy { id: id.to_string() })
                    }
                    Some(m) => Arc::clone(m),
                },
            }
        };
        let retired = model.scheduler.send(Retire).await.unwrap_or(false);
        if !retired {
            return Err(ModelError::Busy { id: id.to_string() });
        }
        let mut slots = self.slots();
        if let Some(s) = slots.iter_mut().find(|s| s.id == id) {
            s.loaded = None;
            s.unloads += 1;
        }
        drop(slots);
        metrics::counter!("smolchat_model_unloads_total", "model" => id.to_string()).increment(1);
        tracing::info!(model = id, "model unloaded");
        Ok(true)
    }

    /// Unloads `id` now (an admin): refused for the main model and while it has requests.
    pub async fn unload(&self, id: &str) -> Result<bool, ModelError> {
        let _changing = self.changing.lock().await;
        self.retire(id).await
    }

    /// Loads `entry` on a blocking thread and starts its scheduler on the system's arbiter.
    async fn load_now(&self, entry: &ModelEntry) -> Result<Arc<ServedModel>, ModelError> {
        let id = entry.id.clone();
        self.set(&id, |s| {
            s.loading = true;
            s.last_error = None;
        });
        tracing::info!(model = %id, path = %entry.path.display(), "loading a model on demand");
        let config = self.config.for_entry(entry);
        let started = Instant::now();
        let loaded = tokio::task::spawn_blocking(move || {
            load::load_model(&config).map(|(engine, tokenizer, template, info)| {
                (engine, tokenizer, template, config, info)
            })
        })
        .await;
        let failed = |message: String| {
            self.set(&id, |s| {
                s.loading = false;
                s.last_error = Some(message.clone());
            });
            tracing::warn!(model = %id, "cannot load the model: {message}");
            ModelError::Load {
                id: id.clone(),
                message,
            }
        };
        let (engine, tokenizer, template, config, mut info) = match loaded {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Err(e) => return Err(failed(format!("the loading thread failed: {e}"))),
        };
        info.id = id.clone();
        let memory_bytes = load::model_memory_bytes(&engine);
        let (tokenizer, template) = (Arc::new(tokenizer), Arc::new(template));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (meter, start_info, start_tok) =
            (self.meter.clone(), info.clone(), Arc::clone(&tokenizer));
        let sent = self.arbiter.spawn_fn(move || {
            let addr = load::start_scheduler(
                &config,
                engine,
                start_tok,
                &start_info,
                &meter,
                Some(&start_info.id),
            );
            let _ = tx.send(addr);
        });
        if !sent {
            return Err(failed("the server is stopping".into()));
        }
        let scheduler = match rx.await {
            Ok(a) => a,
            Err(_) => return Err(failed("the scheduler did not start".into())),
        };
        let completions = self
            .completions
            .for_scheduler(scheduler.clone(), info.context_window);
        let load_s = started.elapsed().as_secs_f64();
        let model = Arc::new(ServedModel::new(
            info,
            tokenizer,
            template,
            scheduler,
            completions,
            memory_bytes,
            entry.thinking,
        ));
        let mut first = None;
        self.set(&id, |s| {
            s.loading = false;
            s.loaded = Some(Arc::clone(&model));
            s.last_used = Instant::now();
            s.load_s = Some(load_s);
            s.loads += 1;
            first = Some((s.path.clone(), Arc::clone(&s.sha256)));
        });
        if let Some((path, sha)) = first {
            record_sha256(&id, &path, &sha);
        }
        metrics::counter!("smolchat_model_loads_total", "model" => id.clone()).increment(1);
        metrics::histogram!("smolchat_model_load_seconds", "model" => id.clone()).record(load_s);
        tracing::info!(model = %id, load_s, memory_mib = memory_bytes >> 20, "model loaded on demand");
        Ok(model)
    }

    fn set(&self, id: &str, f: impl FnOnce(&mut Slot)) {
        if let Some(s) = self.slots().iter_mut().find(|s| s.id == id) {
            f(s);
        }
    }

    /// How long an entry stays loaded when idle (`keep_alive_s`, else `models.keep_alive_s`);
    /// `None`: until unloaded for room or by an admin (the main model; a negative setting).
    fn keep_alive(&self, slot: &Slot) -> Option<Duration> {
        let keep = slot
            .entry
            .as_ref()?
            .keep_alive_s
            .unwrap_or(self.config.models.keep_alive_s);
        u64::try_from(keep).ok().map(Duration::from_secs)
    }

    /// Whether a loaded entry has been idle past its keep-alive.
    fn expired(&self, slot: &Slot) -> bool {
        slot.loaded.is_some()
            && self
                .keep_alive(slot)
                .is_some_and(|keep| slot.last_used.elapsed() >= keep)
    }

    /// Unloads models idle past their keep-alive, every few seconds.
    fn spawn_keep_alive(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        actix::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            loop {
                tick.tick().await;
                let Some(models) = weak.upgrade() else { return };
                let expired: Vec<String> = models
                    .slots()
                    .iter()
                    .filter(|s| models.expired(s))
                    .map(|s| s.id.clone())
                    .collect();
                for id in expired {
                    let _changing = models.changing.lock().await;
                    // Still idle past its keep-alive (a request may have come meanwhile)?
                    let still = models
                        .slots()
                        .iter()
                        .any(|s| s.id == id && models.expired(s));
                    if still {
                        match models.retire(&id).await {
                            Ok(_) => tracing::info!(model = %id, "unloaded after its keep-alive"),
                            Err(e) => tracing::debug!(model = %id, "kept: {e}"),
                        }
                    }
                }
            }
        });
    }

    /// Drops a conversation's KV cache on every loaded model (`keep_on_disk`: into its spill
    /// tier, an admin freeing memory; otherwise forgotten there too, a deleted conversation).
    /// Whether any model had one.
    pub async fn evict(&self, conversation: uuid::Uuid, keep_on_disk: bool) -> bool {
        if !keep_on_disk {
            // The models not loaded keep their spilled caches in folders of their own: a
            // deleted conversation's file there goes too.
            let unloaded: Vec<String> = self
                .slots()
                .iter()
                .filter(|s| s.entry.is_some() && s.loaded.is_none() && !s.loading)
                .map(|s| s.id.clone())
                .collect();
            for id in unloaded {
                if let Some(dir) = load::spill_dir(&self.config, Some(&id)) {
                    smolchat_serving::spill::SpillTier::forget_in(&dir, conversation);
                }
            }
        }
        let mut any = false;
        for m in self.all_loaded() {
            any |= m
                .scheduler
                .send(smolchat_serving::scheduler::Evict {
                    conversation,
                    keep_on_disk,
                })
                .await
                .unwrap_or(false);
        }
        any
    }

    /// Reads a conversation's spilled cache ahead on its model, when that model is loaded.
    pub fn prefetch(&self, conversation: uuid::Uuid, model: Option<&str>) {
        let id = self
            .find(model.unwrap_or(""))
            .unwrap_or_else(|_| self.default_id());
        if let Some(m) = self.peek(&id) {
            m.prefetch(conversation);
        }
    }

    /// Writes every loaded model's idle caches to its spill tier (the server is stopping).
    pub(crate) async fn spill_all(&self) {
        for m in self.all_loaded() {
            let _ = m
                .scheduler
                .send(smolchat_serving::scheduler::SpillAll)
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(id: &str, path: &str, aliases: &[&str]) -> Slot {
        let aliases: Vec<String> = aliases.iter().map(|a| a.to_string()).collect();
        Slot::new(id, path.into(), &aliases, None)
    }

    /// A model answers to its id, its aliases and its file's name, never to its path.
    #[test]
    fn a_model_is_named_by_its_id_aliases_and_file_name() {
        let s = slot(
            "smollm3",
            "/srv/models/SmolLM3-Q4_K_M.gguf",
            &["gpt-4o-mini"],
        );
        for name in ["smollm3", "gpt-4o-mini", "SmolLM3-Q4_K_M.gguf"] {
            assert!(s.is_named(name), "{name}");
        }
        for name in ["/srv/models/SmolLM3-Q4_K_M.gguf", "SMOLLM3", "gpt-4o", ""] {
            assert!(!s.is_named(name), "{name}");
        }
    }

    /// `models.task = "auto"` adds the embedded SmolLM2 only when the main model is another
    /// file, the file is there, and no entry serves it already.
    #[test]
    fn the_automatic_task_model_is_smollm2_beside_another_main_model() {
        let mut c = Config::default();
        // The main model is SmolLM2 itself: no task model.
        assert!(implicit_task_entry(&c).is_none());
        c.model.path = "models/SmolLM3-3B.gguf".into();
        let small = std::path::Path::new(crate::config::DEFAULT_MODEL);
        match implicit_task_entry(&c) {
            Some(e) => {
                assert!(small.exists());
                assert_eq!(e.id, "SmolLM2-135M-Instruct.Q4_1");
                assert_eq!(e.path, small);
            }
            None => assert!(!small.exists(), "the default model's file is there"),
        }
        c.models.entries.push(ModelEntry {
            id: "small".into(),
            path: small.to_path_buf(),
            ..ModelEntry::default()
        });
        assert!(
            implicit_task_entry(&c).is_none(),
            "an entry serves it already"
        );
        c.models.entries.clear();
        c.models.task = "off".into();
        assert!(implicit_task_entry(&c).is_none());
    }

    /// Before loading, a model counts as its file and its KV budget: the one set, or the
    /// CPU's default; on a GPU without one, only the file (the rest is counted once loaded).
    #[test]
    fn the_estimate_before_a_load_counts_the_file_and_the_kv_budget() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("m.gguf");
        std::fs::write(&file, vec![0u8; 1000]).expect("write");
        let c = Config::default();
        let mut e = ModelEntry {
            id: "m".into(),
            path: file,
            ..ModelEntry::default()
        };
        assert_eq!(estimate_bytes(&c, &e), 1000 + (2048 << 20));
        e.kv_budget_mib = Some(16);
        assert_eq!(estimate_bytes(&c, &e), 1000 + (16 << 20));
        e.kv_budget_mib = None;
        e.device = Some(smolchat_engine::device::DeviceRequest::Cuda(0));
        assert_eq!(estimate_bytes(&c, &e), 1000);
    }
}
