//! The KV tier below the device: conversations' KV caches written to disk when they are evicted
//! or go idle, and read back when the conversation returns, instead of computing its prompt
//! again (a 4,000-token conversation costs about 40 s of prefill on two CPU cores for the 3B
//! shape; reading its blocks back, a fraction of a second).
//!
//! One file per conversation (`<id>.kv`) in the replica's spill directory, written to a
//! temporary name, synced and renamed, so a file is whole or absent. A file says what it holds
//! (its header): the model file's identity and the backend's KV block format it was saved
//! under, the tokens its positions were computed for, and a SHA-256 of the tokens and the
//! compressed blocks. Files are compressed and written on a thread of their own (a 3B-shape
//! conversation of 4,000 tokens is about 295 MB of f16 K/V, a second of work the running replies
//! must not wait for); a conversation whose write is still under way comes back from the
//! snapshot in memory. It is restored only into the same model and format, only as far as its
//! tokens agree with the new prompt (an edited or branched history keeps the common prefix),
//! and only when the hash holds: a torn, stale or foreign file falls back to computing, never to
//! a wrong reply. The blocks are compressed with zstd (lossless: a restored cache is bit for
//! bit the cache it was). The tier keeps within a budget in bytes, dropping the least recently
//! used files first, and survives restarts: [`SpillTier::open`] scans the directory and drops
//! what no longer matches.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Instant, SystemTime};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use smolchat_engine::KvSnapshot;
use uuid::Uuid;

/// The first bytes of every spill file (the version in its last character).
const MAGIC: &[u8; 8] = b"SMOLKV1\n";
/// zstd's fastest level: the tier is written on the model thread, and level 1 already takes
/// most of what f16 K/V gives up (measured in `docs/BENCHMARKS.md`).
const ZSTD_LEVEL: i32 = 1;
/// The longest header a file may claim (a corrupt length is not believed).
const MAX_HEADER: usize = 1 << 16;
/// Bytes of snapshots waiting for the writer thread beyond which a new write waits for it
/// (evictions faster than the disk must not pile up memory).
const MAX_PENDING_BYTES: usize = 1 << 30;

/// Where and how much (`scheduler.kv_spill_*`), for the model whose identity is `model`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillSettings {
    /// This replica's own directory.
    pub dir: PathBuf,
    pub budget_bytes: u64,
    /// A conversation's cache idle this long is written (so a restart finds it).
    pub idle: std::time::Duration,
    /// The model file's identity (name, size, modification time, a hash of its head, and the
    /// settings that change its K/V): files of another identity are dropped.
    pub model: String,
    /// Bytes of recently written snapshots also kept in host memory (a GPU's tier between VRAM
    /// and disk; 0: none).
    pub ram_bytes: usize,
}

/// What a spill file's header says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Header {
    /// The model file's identity ([`SpillTier::open`]'s `model`).
    model: String,
    /// The backend's KV block format.
    format: String,
    conversation: Uuid,
    /// Tokens (their positions' K/V follow).
    tokens: usize,
    /// Bytes of the blocks, before and after compression.
    raw_bytes: usize,
    data_bytes: usize,
    /// SHA-256 of the tokens' bytes and the compressed blocks, hex.
    sha256: String,
}

/// Why a spill file was not used.
#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("reading or writing the KV spill file: {0}")]
    Io(#[from] io::Error),
    #[error("the KV spill file is not one (or is torn): {0}")]
    Corrupt(String),
    #[error("the KV spill file is for another model or KV format ({0})")]
    Stale(String),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    bytes: u64,
    used: SystemTime,
}

/// What [`SpillTier::open`] found in the directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScanReport {
    pub kept: usize,
    pub dropped: usize,
    pub bytes: u64,
}

/// A write handed to the writer thread.
struct Job {
    conversation: Uuid,
    generation: u64,
    snapshot: Arc<KvSnapshot>,
}

/// What the writer thread did with a [`Job`]: the file's size (`None`: larger than the whole
/// budget, not written), or why it failed; and how long it took.
struct Report {
    conversation: Uuid,
    generation: u64,
    result: Result<Option<u64>, String>,
    seconds: f64,
}

/// A file for the loader thread to read ahead ([`SpillTier::preload`]).
struct LoadJob {
    conversation: Uuid,
    generation: u64,
    path: PathBuf,
}

/// What the loader read: the snapshot, or why the file is not usable.
struct LoadReport {
    conversation: Uuid,
    generation: u64,
    result: Result<KvSnapshot, String>,
}

/// Snapshots read ahead and not taken yet are kept within this many bytes (the oldest go).
const MAX_LOADED_BYTES: usize = 1 << 30;

/// The spill files of one replica, within a budget.
pub struct SpillTier {
    dir: PathBuf,
    budget: u64,
    model: String,
    /// Files on disk, whole.
    entries: HashMap<Uuid, Entry>,
    /// The newest write handed to the writer and not reported, per conversation.
    pending: HashMap<Uuid, (u64, Arc<KvSnapshot>)>,
    next_generation: u64,
    /// Jobs handed over and not reported yet (replaced ones included).
    in_flight: usize,
    /// The host-RAM tier above the files (on a GPU: between VRAM and disk): the snapshots of
    /// the files most recently written, within `ram_budget` bytes, so a conversation that comes
    /// back soon is copied from memory rather than read and decompressed.
    ram: HashMap<Uuid, (Arc<KvSnapshot>, Instant)>,
    ram_budget: usize,
    /// Conversations restored from memory (the RAM tier or a write under way).
    pub ram_restores: u64,
    jobs: Option<mpsc::Sender<Job>>,
    reports: mpsc::Receiver<Report>,
    writer: Option<std::thread::JoinHandle<()>>,
    /// Files written and read back since start (tests, metrics).
    pub writes: u64,
    pub restores: u64,
    /// Conversations that came back to the worker with no cache on the device and none here
    /// (new conversations among them), and files found here but not usable (torn, stale).
    pub misses: u64,
    pub rejected: u64,
    /// Time spent restoring caches into the engine (reading, decompressing, copying in), in
    /// microseconds, over `restores`.
    pub restore_micros: u64,
    /// Files read ahead on the loader thread (see [`SpillTier::preload`]): those being read
    /// (with the generation they were asked under), and those read and not taken yet.
    loads: Option<mpsc::Sender<LoadJob>>,
    loaded_reports: mpsc::Receiver<LoadReport>,
    loader: Option<std::thread::JoinHandle<()>>,
    loading: HashMap<Uuid, u64>,
    loaded: HashMap<Uuid, (Result<KvSnapshot, String>, Instant)>,
    /// Files read ahead since start.
    pub preloads: u64,
}

impl SpillTier {
    /// Deletes `conversation`'s file (and a leftover of its write) in the folder of a tier that
    /// is not open (its model is not loaded): a deleted conversation leaves nothing on disk.
    pub fn forget_in(dir: &Path, conversation: Uuid) {
        for name in [
            format!("{conversation}.kv"),
            format!("{conversation}.kv.tmp"),
        ] {
            match fs::remove_file(dir.join(&name)) {
                Ok(()) => {
                    tracing::debug!(%conversation, "a spilled cache of an unloaded model deleted")
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(file = %dir.join(&name).display(), "cannot delete a spilled cache: {e}")
                }
            }
        }
    }

    /// The tier in `dir` (created when missing) for the model whose identity is `model`,
    /// holding at most `budget` bytes: files of another model, torn ones, leftovers of
    /// interrupted writes and those past the budget (oldest first) are deleted.
    pub fn open(dir: &Path, budget: u64, model: &str) -> io::Result<(Self, ScanReport)> {
        fs::create_dir_all(dir)?;
        let (jobs, queue) = mpsc::channel::<Job>();
        let (done, reports) = mpsc::channel::<Report>();
        let (writer_dir, writer_model) = (dir.to_path_buf(), model.to_string());
        let writer = std::thread::Builder::new()
            .name("smolchat-kv-spill".into())
            .spawn(move || {
                for job in queue {
                    let started = Instant::now();
                    let result = write_file(
                        &writer_dir,
                        &writer_model,
                        budget,
                        job.conversation,
                        &job.snapshot,
                    )
                    .map_err(|e| e.to_string());
                    let report = Report {
                        conversation: job.conversation,
                        generation: job.generation,
                        result,
                        seconds: started.elapsed().as_secs_f64(),
                    };
                    if done.send(report).is_err() {
                        return;
                    }
                }
            })?;
        let (loads, load_queue) = mpsc::channel::<LoadJob>();
        let (loaded_tx, loaded_reports) = mpsc::channel::<LoadReport>();
        let loader_model = model.to_string();
        let loader = std::thread::Builder::new()
            .name("smolchat-kv-load".into())
            .spawn(move || {
                for job in load_queue {
                    let result = read_file(&job.path, &loader_model, job.conversation)
                        .map_err(|e| e.to_string());
                    let report = LoadReport {
                        conversation: job.conversation,
                        generation: job.generation,
                        result,
                    };
                    if loaded_tx.send(report).is_err() {
                        return;
                    }
                }
            })?;
        let mut tier = Self {
            dir: dir.to_path_buf(),
            budget,
            model: model.to_string(),
            entries: HashMap::new(),
            pending: HashMap::new(),
            next_generation: 0,
            in_flight: 0,
            ram: HashMap::new(),
            ram_budget: 0,
            ram_restores: 0,
            jobs: Some(jobs),
            reports,
            writer: Some(writer),
            writes: 0,
            restores: 0,
            misses: 0,
            rejected: 0,
            restore_micros: 0,
            loads: Some(loads),
            loaded_reports,
            loader: Some(loader),
            loading: HashMap::new(),
            loaded: HashMap::new(),
            preloads: 0,
        };
        let mut report = ScanReport::default();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let id = name
                .strip_suffix(".kv")
                .and_then(|stem| Uuid::parse_str(stem).ok());
            let meta = entry.metadata()?;
            let kept = match id {
                Some(id) if meta.is_file() => match read_header(&path) {
                    Ok((h, _)) if h.model == tier.model && h.conversation == id => {
                        let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                        tier.entries.insert(
                            id,
                            Entry {
                                bytes: meta.len(),
                                used,
                            },
                        );
                        true
                    }
                    _ => false,
                },
                // Not ours (or an interrupted write's temporary file): only our own names are
                // removed.
                _ => !(name.ends_with(".kv") || name.ends_with(".kv.tmp")),
            };
            if !kept {
                let _ = fs::remove_file(&path);
                report.dropped += 1;
            }
        }
        tier.trim(0);
        report.kept = tier.entries.len();
        report.bytes = tier.bytes();
        Ok((tier, report))
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Keeps the snapshots of the most recently written files in memory too, within `bytes`
    /// (0: none).
    pub fn with_ram(mut self, bytes: usize) -> Self {
        self.ram_budget = bytes;
        self
    }

    /// Bytes of snapshots the RAM tier holds.
    pub fn ram_bytes(&self) -> usize {
        self.ram.values().map(|(s, _)| s.bytes.len()).sum()
    }

    /// Keeps `snapshot` in the RAM tier, dropping the least recently kept beyond its budget.
    fn keep_in_ram(&mut self, conversation: Uuid, snapshot: Arc<KvSnapshot>) {
        if snapshot.bytes.len() > self.ram_budget {
            return;
        }
        self.ram.insert(conversation, (snapshot, Instant::now()));
        while self.ram_bytes() > self.ram_budget {
            let Some((&oldest, _)) = self.ram.iter().min_by_key(|(_, (_, at))| *at) else {
                break;
            };
            self.ram.remove(&oldest);
        }
    }

    /// Bytes of the files held.
    pub fn bytes(&self) -> u64 {
        self.entries.values().map(|e| e.bytes).sum()
    }

    pub fn files(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds `conversation`'s cache (on disk, or on its way there).
    pub fn contains(&self, conversation: Uuid) -> bool {
        self.entries.contains_key(&conversation) || self.pending.contains_key(&conversation)
    }

    fn path(&self, conversation: Uuid) -> PathBuf {
        self.dir.join(format!("{conversation}.kv"))
    }

    /// Hands `snapshot` to the writer thread as `conversation`'s file (replacing an older
    /// one). A snapshot larger than the whole budget is not written (and an older file of it is
    /// dropped: it would be older than the cache it stood for). Waits for the writer only when
    /// more than [`MAX_PENDING_BYTES`] wait for it.
    pub fn put(&mut self, conversation: Uuid, snapshot: KvSnapshot) -> Result<(), SpillError> {
        self.collect();
        self.forget_load(conversation);
        let generation = self.next_generation;
        self.next_generation += 1;
        let snapshot = Arc::new(snapshot);
        let sent = self.jobs.as_ref().map(|jobs| {
            jobs.send(Job {
                conversation,
                generation,
                snapshot: Arc::clone(&snapshot),
            })
        });
        if !matches!(sent, Some(Ok(()))) {
            return Err(SpillError::Io(io::Error::other(
                "the spill writer has stopped",
            )));
        }
        self.in_flight += 1;
        self.pending.insert(conversation, (generation, snapshot));
        while self.pending_bytes() > MAX_PENDING_BYTES && self.wait_one() {}
        Ok(())
    }

    fn pending_bytes(&self) -> usize {
        self.pending.values().map(|(_, s)| s.bytes.len()).sum()
    }

    /// Applies the writer's reports so far, without waiting.
    fn collect(&mut self) {
        while let Ok(report) = self.reports.try_recv() {
            self.apply(report);
        }
    }

    /// Waits for the writer's next report; whether there was one to wait for.
    fn wait_one(&mut self) -> bool {
        if self.in_flight == 0 {
            return false;
        }
        match self.reports.recv() {
            Ok(report) => {
                self.apply(report);
                true
            }
            Err(_) => {
                self.in_flight = 0;
                false
            }
        }
    }

    /// Waits until every write handed over is on disk (or failed).
    pub fn flush(&mut self) {
        self.collect();
        while self.wait_one() {}
    }

    fn apply(&mut self, report: Report) {
        self.in_flight = self.in_flight.saturating_sub(1);
        let conversation = report.conversation;
        let latest = self.pending.get(&conversation).map(|p| p.0) == Some(report.generation);
        if !latest {
            // Replaced by a newer write (which renames over it), or given up: a conversation
            // deleted or restored meanwhile must leave no file behind.
            if !self.pending.contains_key(&conversation) && report.result.is_ok() {
                self.entries.remove(&conversation);
                let _ = fs::remove_file(self.path(conversation));
            }
            return;
        }
        let written = self.pending.remove(&conversation).map(|(_, s)| s);
        match report.result {
            Ok(Some(size)) => {
                if let Some(snapshot) = written {
                    self.keep_in_ram(conversation, snapshot);
                }
                self.entries.insert(
                    conversation,
                    Entry {
                        bytes: size,
                        used: SystemTime::now(),
                    },
                );
                self.writes += 1;
                metrics::counter!("smolchat_kv_spill_writes_total").increment(1);
                metrics::counter!("smolchat_kv_spill_written_bytes_total").increment(size);
                metrics::histogram!("smolchat_kv_spill_write_seconds").record(report.seconds);
                // Past the budget: the least recently used other files go.
                while self.bytes() > self.budget {
                    let Some((&oldest, _)) = self
                        .entries
                        .iter()
                        .filter(|(&id, _)| id != conversation)
                        .min_by_key(|(_, e)| e.used)
                    else {
                        break;
                    };
                    self.remove_file(oldest);
                }
            }
            Ok(None) => self.remove_file(conversation),
            Err(e) => {
                tracing::warn!(%conversation, "writing a KV cache to the spill tier failed: {e}");
            }
        }
    }

    /// Starts reading `conversation`'s file on the loader thread (read, checked and
    /// decompressed there), so that [`Self::take`] finds it in memory: called when the
    /// conversation shows signs of coming back (its page opened, a message on its way), so the
    /// model thread neither reads the file nor waits for it. Whether a read was started (not
    /// when there is no file, or it is in memory or being read already).
    pub fn preload(&mut self, conversation: Uuid) -> bool {
        self.collect();
        self.collect_loads();
        let present = self.entries.contains_key(&conversation);
        let in_memory = self.pending.contains_key(&conversation)
            || self.ram.contains_key(&conversation)
            || self.loaded.contains_key(&conversation)
            || self.loading.contains_key(&conversation);
        if !present || in_memory {
            return false;
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let sent = self.loads.as_ref().is_some_and(|loads| {
            loads
                .send(LoadJob {
                    conversation,
                    generation,
                    path: self.path(conversation),
                })
                .is_ok()
        });
        if sent {
            self.loading.insert(conversation, generation);
            self.preloads += 1;
            metrics::counter!("smolchat_kv_spill_preloads_total").increment(1);
        }
        sent
    }

    /// Whether `conversation`'s file is being read ahead right now.
    pub fn is_loading(&mut self, conversation: Uuid) -> bool {
        self.collect_loads();
        self.loading.contains_key(&conversation)
    }

    /// Applies the loader's reports so far, without waiting; a read that was asked under an
    /// older generation (its file rewritten or removed since) is dropped.
    fn collect_loads(&mut self) {
        while let Ok(report) = self.loaded_reports.try_recv() {
            self.apply_load(report);
        }
    }

    fn apply_load(&mut self, report: LoadReport) {
        if self.loading.get(&report.conversation) != Some(&report.generation) {
            return;
        }
        self.loading.remove(&report.conversation);
        self.loaded
            .insert(report.conversation, (report.result, Instant::now()));
        let size = |r: &Result<KvSnapshot, String>| r.as_ref().map_or(0, |s| s.bytes.len());
        while self.loaded.values().map(|(r, _)| size(r)).sum::<usize>() > MAX_LOADED_BYTES {
            let Some((&oldest, _)) = self.loaded.iter().min_by_key(|(_, (_, at))| *at) else {
                break;
            };
            self.loaded.remove(&oldest);
        }
    }

    /// Waits for the read ahead of `conversation`, if one is under way.
    fn wait_load(&mut self, conversation: Uuid) {
        while self.loading.contains_key(&conversation) {
            match self.loaded_reports.recv() {
                Ok(report) => self.apply_load(report),
                Err(_) => {
                    self.loading.clear();
                    return;
                }
            }
        }
    }

    /// Forgets any read ahead of `conversation` (its file is rewritten or removed).
    fn forget_load(&mut self, conversation: Uuid) {
        self.loading.remove(&conversation);
        self.loaded.remove(&conversation);
    }

    /// `conversation`'s saved K/V, read and checked, the file removed (the cache it restores is
    /// the one kept from then on). `Ok(None)` when there is none; an error (the file removed
    /// too) when it is torn or for another model. A read ahead under way is waited for.
    pub fn take(&mut self, conversation: Uuid) -> Result<Option<KvSnapshot>, SpillError> {
        self.collect();
        self.collect_loads();
        self.wait_load(conversation);
        if let Some((read, _)) = self.loaded.remove(&conversation) {
            if self.entries.remove(&conversation).is_some() {
                let _ = fs::remove_file(self.path(conversation));
                let snapshot = read.map_err(SpillError::Corrupt)?;
                self.restores += 1;
                return Ok(Some(snapshot));
            }
        }
        if let Some((_, snapshot)) = self.pending.remove(&conversation) {
            // Still being written: the snapshot in memory serves, and the file goes when the
            // writer reports it (with any older one now).
            self.remove_file(conversation);
            self.restores += 1;
            self.ram_restores += 1;
            return Ok(Some(
                Arc::try_unwrap(snapshot).unwrap_or_else(|shared| (*shared).clone()),
            ));
        }
        if let Some((snapshot, _)) = self.ram.remove(&conversation) {
            // Its file is the same blocks: it goes, as a read one would.
            self.remove_file(conversation);
            self.restores += 1;
            self.ram_restores += 1;
            return Ok(Some(
                Arc::try_unwrap(snapshot).unwrap_or_else(|shared| (*shared).clone()),
            ));
        }
        if self.entries.remove(&conversation).is_none() {
            return Ok(None);
        }
        let path = self.path(conversation);
        let read = read_file(&path, &self.model, conversation);
        let _ = fs::remove_file(&path);
        let snapshot = read?;
        self.restores += 1;
        Ok(Some(snapshot))
    }

    /// Deletes `conversation`'s file, and any write of it under way (its conversation was
    /// deleted).
    pub fn remove(&mut self, conversation: Uuid) {
        self.collect();
        self.pending.remove(&conversation);
        self.remove_file(conversation);
    }

    fn remove_file(&mut self, conversation: Uuid) {
        self.ram.remove(&conversation);
        self.forget_load(conversation);
        if self.entries.remove(&conversation).is_some() {
            let _ = fs::remove_file(self.path(conversation));
        }
    }

    /// Deletes the least recently used files until `room` more bytes fit the budget.
    fn trim(&mut self, room: u64) {
        while self.bytes() + room > self.budget {
            let Some((&oldest, _)) = self.entries.iter().min_by_key(|(_, e)| e.used) else {
                return;
            };
            self.remove_file(oldest);
        }
    }
}

impl Drop for SpillTier {
    /// Finishes the writes handed over (a stopping server keeps what it spilled).
    fn drop(&mut self) {
        self.flush();
        self.jobs = None;
        self.loads = None;
        if let Some(loader) = self.loader.take() {
            let _ = loader.join();
        }
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// Compresses `snapshot` and writes it as `conversation`'s file in `dir` (a temporary name,
/// synced, renamed); its size, or `None` when it would not fit `budget` at all.
fn write_file(
    dir: &Path,
    model: &str,
    budget: u64,
    conversation: Uuid,
    snapshot: &KvSnapshot,
) -> Result<Option<u64>, SpillError> {
    let data = zstd::bulk::compress(&snapshot.bytes, ZSTD_LEVEL)?;
    let tokens: Vec<u8> = snapshot
        .tokens
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    let header = Header {
        model: model.to_string(),
        format: snapshot.format.clone(),
        conversation,
        tokens: snapshot.tokens.len(),
        raw_bytes: snapshot.bytes.len(),
        data_bytes: data.len(),
        sha256: digest(&tokens, &data),
    };
    let header = serde_json::to_vec(&header)
        .map_err(|e| SpillError::Corrupt(format!("the header did not serialize: {e}")))?;
    let size = (MAGIC.len() + 4 + header.len() + tokens.len() + data.len()) as u64;
    if size > budget {
        return Ok(None);
    }
    let path = dir.join(format!("{conversation}.kv"));
    let tmp = dir.join(format!("{conversation}.kv.tmp"));
    let written = (|| -> io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&(header.len() as u32).to_le_bytes())?;
        f.write_all(&header)?;
        f.write_all(&tokens)?;
        f.write_all(&data)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e.into());
    }
    Ok(Some(size))
}

fn digest(tokens: &[u8], data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(tokens);
    h.update(data);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A file's header and the bytes after it.
fn read_header(path: &Path) -> Result<(Header, usize), SpillError> {
    let mut f = fs::File::open(path)?;
    let mut head = [0u8; 12];
    f.read_exact(&mut head)
        .map_err(|_| SpillError::Corrupt("shorter than its header".into()))?;
    if &head[..8] != MAGIC {
        return Err(SpillError::Corrupt("no spill file magic".into()));
    }
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    if len > MAX_HEADER {
        return Err(SpillError::Corrupt(format!("a header of {len} bytes")));
    }
    let mut header = vec![0u8; len];
    f.read_exact(&mut header)
        .map_err(|_| SpillError::Corrupt("the header is cut short".into()))?;
    let header: Header = serde_json::from_slice(&header)
        .map_err(|e| SpillError::Corrupt(format!("the header does not parse: {e}")))?;
    Ok((header, 12 + len))
}

fn read_file(path: &Path, model: &str, conversation: Uuid) -> Result<KvSnapshot, SpillError> {
    let (header, start) = read_header(path)?;
    if header.model != model || header.conversation != conversation {
        return Err(SpillError::Stale(format!(
            "saved for {} of conversation {}",
            header.model, header.conversation
        )));
    }
    let bytes = fs::read(path)?;
    let body = &bytes[start.min(bytes.len())..];
    let token_bytes = header.tokens * 4;
    if body.len() != token_bytes + header.data_bytes {
        return Err(SpillError::Corrupt(format!(
            "{} bytes after the header, {} expected",
            body.len(),
            token_bytes + header.data_bytes
        )));
    }
    let (tokens, data) = body.split_at(token_bytes);
    if digest(tokens, data) != header.sha256 {
        return Err(SpillError::Corrupt("the hash does not hold".into()));
    }
    let raw = zstd::bulk::decompress(data, header.raw_bytes)?;
    if raw.len() != header.raw_bytes {
        return Err(SpillError::Corrupt(
            "the blocks decompress to another size".into(),
        ));
    }
    Ok(KvSnapshot {
        tokens: tokens
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        format: header.format,
        bytes: raw,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(n: u32, seed: u8) -> KvSnapshot {
        KvSnapshot {
            tokens: (0..n).collect(),
            format: "cpu-pages-f16-v1".into(),
            // Compressible like K/V: runs of similar bytes.
            bytes: (0..4096u32)
                .map(|i| seed.wrapping_add((i / 7) as u8))
                .collect(),
        }
    }

    /// A file read back is the snapshot written; the tier survives a reopen, drops files of
    /// another model, torn ones and temporary leftovers, and keeps within its budget by
    /// dropping the least recently used.
    #[test]
    fn files_round_trip_and_survive_only_when_they_match() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b, c) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        let (mut tier, report) = SpillTier::open(dir.path(), 1 << 20, "model-1").expect("open");
        assert_eq!(report, ScanReport::default());
        tier.put(a, snapshot(40, 1)).expect("put");
        tier.put(b, snapshot(7, 2)).expect("put");
        tier.flush();
        assert_eq!(tier.writes, 2);
        assert!(
            tier.bytes() < 2 * 4096,
            "zstd compressed to {} bytes",
            tier.bytes()
        );
        // Read back from the file (the write is done).
        assert_eq!(tier.take(a).expect("take"), Some(snapshot(40, 1)));
        assert!(!tier.contains(a) && tier.take(a).expect("again").is_none());

        // A restart finds b; another model's tier drops it.
        drop(tier);
        fs::write(dir.path().join(format!("{c}.kv.tmp")), b"half written").expect("tmp");
        fs::write(dir.path().join("notes.txt"), b"not ours").expect("other");
        let (mut tier, report) = SpillTier::open(dir.path(), 1 << 20, "model-1").expect("reopen");
        assert_eq!((report.kept, report.dropped), (1, 1));
        assert!(
            dir.path().join("notes.txt").exists(),
            "a file not ours was deleted"
        );
        assert_eq!(tier.take(b).expect("take"), Some(snapshot(7, 2)));
        tier.put(b, snapshot(7, 2)).expect("put");
        drop(tier);
        let (tier, report) = SpillTier::open(dir.path(), 1 << 20, "model-2").expect("other model");
        assert_eq!((report.kept, report.dropped), (0, 1));
        assert_eq!(tier.files(), 0);
        drop(tier);

        // Torn: a file cut short, or one byte flipped, is refused and removed.
        let (mut tier, _) = SpillTier::open(dir.path(), 1 << 20, "model-1").expect("open");
        let path = dir.path().join(format!("{a}.kv"));
        tier.put(a, snapshot(40, 1)).expect("put");
        tier.flush();
        let mut bytes = fs::read(&path).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        fs::write(&path, &bytes).expect("flip");
        assert!(matches!(tier.take(a), Err(SpillError::Corrupt(_))));
        assert!(!path.exists());
        tier.put(a, snapshot(40, 1)).expect("put");
        tier.flush();
        let bytes = fs::read(&path).expect("read");
        fs::write(&path, &bytes[..bytes.len() - 5]).expect("cut");
        assert!(tier.take(a).is_err());

        // Taken or removed while still being written: served from memory, no file left.
        tier.put(c, snapshot(40, 3)).expect("put");
        assert_eq!(tier.take(c).expect("take"), Some(snapshot(40, 3)));
        tier.put(b, snapshot(40, 2)).expect("put");
        tier.remove(b);
        tier.flush();
        let name = |id: Uuid| dir.path().join(format!("{id}.kv"));
        assert!(!name(b).exists() && !name(c).exists());

        // The budget: room for two files; a third drops the least recently used.
        tier.put(a, snapshot(40, 1)).expect("put");
        tier.flush();
        let one = tier.bytes();
        drop(tier);
        let (mut tier, _) =
            SpillTier::open(dir.path(), 2 * one + one / 2, "model-1").expect("open");
        std::thread::sleep(std::time::Duration::from_millis(20));
        tier.put(b, snapshot(40, 2)).expect("put");
        tier.flush();
        std::thread::sleep(std::time::Duration::from_millis(20));
        tier.put(c, snapshot(40, 3)).expect("put");
        tier.flush();
        assert!(!tier.contains(a) && tier.contains(b) && tier.contains(c));
        assert!(tier.bytes() <= 2 * one + one / 2);
        drop(tier);
        // Too big for the whole budget: not written, and an older file of it dropped.
        let (mut small, _) = SpillTier::open(dir.path(), one / 2, "model-1").expect("open");
        assert_eq!(small.files(), 0);
        small.put(a, snapshot(40, 1)).expect("put");
        small.flush();
        assert!(!small.contains(a) && !name(a).exists());

        // The RAM tier: a written snapshot comes back from memory (its file goes too), within
        // its budget.
        let ram_dir = tempfile::tempdir().expect("tempdir");
        let (tier, _) = SpillTier::open(ram_dir.path(), 1 << 20, "model-1").expect("open");
        // Room for one 4,096-byte snapshot.
        let mut ram = tier.with_ram(4096 + 100);
        ram.put(b, snapshot(40, 2)).expect("put");
        ram.put(c, snapshot(40, 3)).expect("put");
        ram.flush();
        assert_eq!(ram.ram_bytes(), 4096, "one of the two fits the RAM budget");
        fs::remove_file(ram_dir.path().join(format!("{c}.kv"))).expect("remove by hand");
        assert_eq!(ram.take(c).expect("from memory"), Some(snapshot(40, 3)));
        assert_eq!(ram.ram_restores, 1);
        assert_eq!(ram.take(b).expect("from the file"), Some(snapshot(40, 2)));
        assert_eq!(ram.ram_restores, 1);
        drop(ram);
    }

    /// A file read ahead on the loader thread is taken from memory (the file removed as a read
    /// would); a rewrite meanwhile makes the read stale and the newer blocks win; a corrupt
    /// file read ahead is refused at take, like one read then; nothing to read starts nothing.
    #[test]
    fn files_read_ahead_are_taken_from_memory_and_never_stale() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b, c) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3));
        let (mut tier, _) = SpillTier::open(dir.path(), 1 << 20, "model-1").expect("open");
        assert!(!tier.preload(a), "no file: nothing to read");
        tier.put(a, snapshot(40, 1)).expect("put");
        tier.put(b, snapshot(30, 2)).expect("put");
        tier.put(c, snapshot(20, 3)).expect("put");
        tier.flush();
        assert!(tier.preload(a));
        assert!(!tier.preload(a), "already being read");
        assert_eq!(tier.take(a).expect("take"), Some(snapshot(40, 1)));
        assert!(!dir.path().join(format!("{a}.kv")).exists());
        assert_eq!((tier.preloads, tier.restores), (1, 1));

        // Read ahead, then written again (the cache came back and was evicted anew).
        assert!(tier.preload(b));
        tier.put(b, snapshot(31, 9)).expect("put");
        tier.flush();
        assert_eq!(tier.take(b).expect("take"), Some(snapshot(31, 9)));

        // A byte flipped before the read ahead: refused when taken, the file gone.
        let path = dir.path().join(format!("{c}.kv"));
        let mut bytes = fs::read(&path).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&path, bytes).expect("write");
        assert!(tier.preload(c));
        assert!(tier.take(c).is_err());
        assert!(!path.exists() && !tier.contains(c));
    }
}
