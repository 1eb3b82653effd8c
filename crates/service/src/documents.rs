//! Reading attached documents where a fault cannot reach the server.
//!
//! A PDF is parsed by code that trusts its input more than a server can: `lopdf`'s parser and
//! `pdf-extract`'s content-stream walk recurse once per nesting level, so a few hundred bytes of
//! nested arrays, or a form XObject that draws itself, overflow the stack. A stack overflow is
//! not a panic: `catch_unwind` cannot catch it and the whole process dies, every running reply
//! with it. So a PDF is read by a child process of our own binary (`smolchat extract`), started
//! with limits on the memory it allocates, CPU time, stack, open files and file writes, killed when it
//! outlives a wall-clock deadline, and its answer read up to a bounded size. Whatever it does,
//! the server sees an exit status and answers a clear 4xx.
//!
//! Text kinds (plain text, Markdown, code, CSV, JSON) are checked in the server: reading them is
//! linear in their size, which the upload limit bounds.
//!
//! Every reading of a file, of any kind, holds one of `limits.max_concurrent_extractions`
//! places, and one owner at most `limits.max_concurrent_extractions_per_owner` of them: beyond
//! either the upload is refused at once with 429 and `Retry-After`, so a client sending many
//! large files at once can neither queue unbounded work nor hold unbounded memory.
//!
//! The child's side is [`child_main`]: it reads the PDF from standard input, applies
//! [`PdfCaps`](crate::files::PdfCaps) (inflated bytes, text bytes) and writes one JSON object
//! to standard output, `{"text": …}` or `{"refused": …}`.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::files::{self, Checked, Extracted, FileError, FileKind, PdfCaps};

/// The most text one PDF may give, in bytes: past any context window a conversation has (64 Ki
/// tokens of even 16 bytes each fit in 1 MiB), so a file cut here could not be used anyway.
pub const MAX_TEXT_BYTES: usize = 4 << 20;
/// The most bytes a PDF's compressed streams (images aside) may inflate to.
pub const MAX_INFLATED_BYTES: usize = 32 << 20;

/// How the child that reads a document is started and bounded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxConfig {
    /// The program, and the arguments before the reader's own, that run [`child_main`]: this
    /// binary and `extract`.
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// The memory the child may allocate (`RLIMIT_DATA`: heap and anonymous mappings, which
    /// the allocator and thread stacks use; not the binary's and libraries' own mappings, so a
    /// build linked to large libraries, CUDA's, starts as well as a small one), in bytes.
    pub memory_bytes: u64,
    /// CPU seconds the child may use (`RLIMIT_CPU`).
    pub cpu_seconds: u64,
    /// Wall-clock time before the child is killed.
    pub timeout: Duration,
    /// The child's main-thread stack (`RLIMIT_STACK`), in bytes.
    pub stack_bytes: u64,
    pub caps: PdfCaps,
    /// Readings at once, on the whole server.
    pub concurrent: usize,
    /// Readings at once, for one owner.
    pub concurrent_per_owner: usize,
}

impl SandboxConfig {
    /// The child is `program extract`, with the limits of `[limits]`.
    pub fn new(program: PathBuf, limits: &crate::config::LimitsConfig) -> Self {
        Self {
            program,
            args: vec!["extract".into()],
            memory_bytes: limits.extract_memory_mib.saturating_mul(1 << 20),
            cpu_seconds: limits.extract_timeout_s.max(1),
            timeout: Duration::from_secs(limits.extract_timeout_s.max(1)),
            stack_bytes: 8 << 20,
            caps: PdfCaps {
                max_inflated_bytes: MAX_INFLATED_BYTES,
                max_text_bytes: MAX_TEXT_BYTES,
            },
            concurrent: limits.max_concurrent_extractions.max(1),
            concurrent_per_owner: limits.max_concurrent_extractions_per_owner.max(1),
        }
    }
}

/// Why a document was not read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file itself is refused (a 4xx that says why).
    #[error(transparent)]
    File(#[from] FileError),
    /// Too many readings at once, for this owner or the server (429).
    #[error("{message}")]
    Busy { message: String, retry_after_s: u64 },
    /// The file's text cannot fit the room it was read for: it has at least this many tokens
    /// (a 400; the caller says what the room was).
    #[error("the file's text is at least {at_least} tokens")]
    DoesNotFit { at_least: usize },
    /// The reader could not be started (a fault on our side).
    #[error("documents cannot be read right now: {0}")]
    Unavailable(String),
}

/// Reads attached files: text kinds here, PDFs in a bounded child process; at most so many at
/// once (see the module documentation).
pub struct DocumentReader {
    config: SandboxConfig,
    /// The vocabulary's longest token, in bytes: a text of N bytes has at least N / this many
    /// tokens.
    longest_token_bytes: usize,
    running: Mutex<Running>,
}

/// The longest token of `tokenizer`'s vocabulary, in bytes (at least 1).
pub fn longest_token_bytes(tokenizer: &smolchat_text::tokenizer::Tokenizer) -> usize {
    (0..tokenizer.vocab_size() as u32)
        .map(|id| tokenizer.token_bytes(id).len())
        .max()
        .unwrap_or(1)
        .max(1)
}

#[derive(Default)]
struct Running {
    total: usize,
    by_owner: HashMap<String, usize>,
}

/// One reading's place; given back when dropped.
struct Place {
    reader: Arc<DocumentReader>,
    owner: String,
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Ok(mut r) = self.reader.running.lock() {
            r.total = r.total.saturating_sub(1);
            if let Some(n) = r.by_owner.get_mut(&self.owner) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    r.by_owner.remove(&self.owner);
                }
            }
        }
    }
}

/// Seconds a client is told to wait when every place is taken.
const RETRY_AFTER_S: u64 = 2;

impl DocumentReader {
    pub fn new(config: SandboxConfig, longest_token_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            config,
            longest_token_bytes: longest_token_bytes.max(1),
            running: Mutex::new(Running::default()),
        })
    }

    pub fn longest_token_bytes(&self) -> usize {
        self.longest_token_bytes
    }

    fn take_place(self: &Arc<Self>, owner: &str) -> Result<Place, ReadError> {
        let mut r = self
            .running
            .lock()
            .map_err(|_| ReadError::Unavailable("the reader's state is poisoned".into()))?;
        let mine = r.by_owner.get(owner).copied().unwrap_or(0);
        if mine >= self.config.concurrent_per_owner {
            return Err(ReadError::Busy {
                message: format!(
                    "you already have {mine} files being read, the most one user may at once \
                     (limits.max_concurrent_extractions_per_owner); send the next when one is done"
                ),
                retry_after_s: RETRY_AFTER_S,
            });
        }
        if r.total >= self.config.concurrent {
            return Err(ReadError::Busy {
                message: format!(
                    "the server is reading {} files already, the most it reads at once \
                     (limits.max_concurrent_extractions); try again in a moment",
                    r.total
                ),
                retry_after_s: RETRY_AFTER_S,
            });
        }
        r.total += 1;
        *r.by_owner.entry(owner.to_string()).or_default() += 1;
        Ok(Place {
            reader: Arc::clone(self),
            owner: owner.to_string(),
        })
    }

    /// Checks and reads the file `name` of `bytes` (at most `limit` bytes) for `owner`, for a
    /// place that holds `room` tokens. Refused by bytes alone when no tokenization could fit it
    /// ([`ReadError::DoesNotFit`]); a PDF's reading stops as soon as its text is that long (or
    /// [`MAX_TEXT_BYTES`]). Nothing here tokenizes: the caller counts what fits.
    pub async fn read(
        self: &Arc<Self>,
        owner: &str,
        name: &str,
        bytes: Vec<u8>,
        limit: usize,
        room: usize,
    ) -> Result<Extracted, ReadError> {
        let checked = files::check(name, &bytes, limit)?;
        // A text kind's text is its bytes (a BOM aside): one too long for the room is refused
        // before it is copied, and without taking a place.
        if checked.kind != FileKind::Pdf {
            let at_least = bytes
                .len()
                .saturating_sub(3)
                .div_ceil(self.longest_token_bytes);
            if at_least > room {
                return Err(ReadError::DoesNotFit { at_least });
            }
        }
        let _place = self.take_place(owner)?;
        let text = if checked.kind == FileKind::Pdf {
            let max_text_bytes = room
                .saturating_add(1)
                .saturating_mul(self.longest_token_bytes);
            let caps = PdfCaps {
                max_text_bytes: max_text_bytes.clamp(1, self.config.caps.max_text_bytes),
                ..self.config.caps
            };
            self.read_pdf(&checked, bytes, caps).await?
        } else {
            let c = checked.clone();
            tokio::task::spawn_blocking(move || files::read_text(&c, &bytes))
                .await
                .map_err(|e| ReadError::Unavailable(format!("the reading task failed: {e}")))??
        };
        let at_least = text.len().div_ceil(self.longest_token_bytes);
        if at_least > room {
            return Err(ReadError::DoesNotFit { at_least });
        }
        Ok(Extracted {
            kind: checked.kind,
            media_type: checked.media_type,
            text,
        })
    }

    /// A PDF's text from a child process (see the module documentation).
    async fn read_pdf(
        &self,
        file: &Checked,
        bytes: Vec<u8>,
        caps: PdfCaps,
    ) -> Result<String, ReadError> {
        let started = std::time::Instant::now();
        let outcome = run_child(&self.config, caps, bytes).await;
        let seconds = started.elapsed().as_secs_f64();
        metrics::histogram!("smolchat_document_read_seconds").record(seconds);
        let answer = match outcome {
            Ok(a) => a,
            Err(ChildFault::Spawn(e)) => {
                tracing::error!(program = %self.config.program.display(), "cannot start the document reader: {e}");
                return Err(ReadError::Unavailable(format!(
                    "the document reader did not start ({e})"
                )));
            }
            Err(fault) => {
                metrics::counter!("smolchat_document_reader_faults_total", "fault" => fault.label())
                    .increment(1);
                tracing::warn!(file = %file.name, seconds, "the document reader failed: {fault}");
                return Err(file.unreadable(fault.to_string()).into());
            }
        };
        match answer {
            ChildAnswer::Text(text) => Ok(text),
            ChildAnswer::Refused(reason) => Err(file.unreadable(reason).into()),
        }
    }
}

/// What the child said.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum ChildAnswer {
    Text(String),
    Refused(String),
}

/// How a child failed to answer. The messages are what a user reads after "is not a PDF the
/// server can read: ".
#[derive(Debug, thiserror::Error)]
enum ChildFault {
    #[error("{0}")]
    Spawn(std::io::Error),
    #[error("reading it took longer than {0} s")]
    Timeout(u64),
    #[error("reading it needed more than {0} MiB of memory")]
    Memory(u64),
    #[error("reading it took more than {0} s of processor time")]
    Cpu(u64),
    #[error("its structure made the reader fail ({0})")]
    Crashed(String),
    #[error("the reader's answer was longer than {0} bytes")]
    TooMuchOutput(usize),
    #[error("the reader gave no answer ({0})")]
    NoAnswer(String),
}

impl ChildFault {
    fn label(&self) -> &'static str {
        match self {
            ChildFault::Spawn(_) => "spawn",
            ChildFault::Timeout(_) => "timeout",
            ChildFault::Memory(_) => "memory",
            ChildFault::Cpu(_) => "cpu",
            ChildFault::Crashed(_) => "crashed",
            ChildFault::TooMuchOutput(_) => "output",
            ChildFault::NoAnswer(_) => "no_answer",
        }
    }
}

/// Stderr kept from a child, for the reason of a crash.
const STDERR_KEPT: usize = 4096;

/// Runs the reader on `input` under `config`'s limits and reads its answer.
async fn run_child(
    config: &SandboxConfig,
    caps: PdfCaps,
    input: Vec<u8>,
) -> Result<ChildAnswer, ChildFault> {
    let mut cmd = tokio::process::Command::new(&config.program);
    cmd.args(&config.args)
        .arg("--max-text-bytes")
        .arg(caps.max_text_bytes.to_string())
        .arg("--max-inflated-bytes")
        .arg(caps.max_inflated_bytes.to_string())
        // Nothing of the server's environment (secrets, database URLs) reaches the child, but
        // where its shared libraries are (a CUDA build finds its libraries through it).
        .env_clear()
        .env("SMOLCHAT_LOG", "off")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        cmd.env("LD_LIBRARY_PATH", paths);
    }
    let limits = [
        (libc::RLIMIT_DATA, config.memory_bytes),
        (libc::RLIMIT_CPU, config.cpu_seconds),
        (libc::RLIMIT_STACK, config.stack_bytes),
        (libc::RLIMIT_CORE, 0),
        (libc::RLIMIT_FSIZE, 0),
        (libc::RLIMIT_NOFILE, 16),
    ];
    // SAFETY: between fork and exec the closure only calls setrlimit, which is
    // async-signal-safe, on values computed before the fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            for (resource, value) in limits {
                let limit = libc::rlimit {
                    rlim_cur: value as libc::rlim_t,
                    rlim_max: value as libc::rlim_t,
                };
                if libc::setrlimit(resource, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(ChildFault::Spawn)?;
    let (Some(mut stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(ChildFault::NoAnswer("its pipes were not opened".into()));
    };
    // JSON escapes a control character in six bytes; anything longer is not an answer.
    let max_answer = caps.max_text_bytes.saturating_mul(6) + 1024;
    let work = async move {
        let feed = async move {
            // A child that stops reading (it crashed) closes the pipe: not our error.
            let _ = stdin.write_all(&input).await;
            drop(stdin);
        };
        let read_out = async move {
            let mut out = Vec::new();
            let mut limited = stdout.take(max_answer as u64 + 1);
            let _ = limited.read_to_end(&mut out).await;
            out
        };
        let read_err = async move {
            let mut err = Vec::new();
            let mut limited = stderr.take(STDERR_KEPT as u64);
            let _ = limited.read_to_end(&mut err).await;
            err
        };
        let ((), out, err) = tokio::join!(feed, read_out, read_err);
        let status = child.wait().await;
        (status, out, err)
    };
    let (status, out, err) = tokio::time::timeout(config.timeout, work)
        .await
        .map_err(|_| ChildFault::Timeout(config.timeout.as_secs()))?;
    let status = status.map_err(|e| ChildFault::NoAnswer(e.to_string()))?;
    if out.len() > max_answer {
        return Err(ChildFault::TooMuchOutput(max_answer));
    }
    let err = String::from_utf8_lossy(&err);
    if !status.success() {
        return Err(fault_of(status, &err, config));
    }
    serde_json::from_slice::<ChildAnswer>(&out)
        .map_err(|e| ChildFault::NoAnswer(format!("its answer did not parse: {e}")))
}

/// What an unsuccessful exit means.
fn fault_of(status: std::process::ExitStatus, stderr: &str, config: &SandboxConfig) -> ChildFault {
    use std::os::unix::process::ExitStatusExt;
    let memory_mib = config.memory_bytes >> 20;
    // Rust aborts (SIGABRT) when an allocation fails, saying so.
    if stderr.contains("memory allocation") || stderr.contains("capacity overflow") {
        return ChildFault::Memory(memory_mib);
    }
    match status.signal() {
        Some(libc::SIGXCPU) => ChildFault::Cpu(config.cpu_seconds),
        Some(libc::SIGKILL) => ChildFault::Cpu(config.cpu_seconds),
        Some(libc::SIGSEGV) | Some(libc::SIGBUS) => {
            ChildFault::Crashed("it nests too deeply or points into itself".into())
        }
        Some(libc::SIGABRT) if stderr.contains("overflowed its stack") => {
            ChildFault::Crashed("it nests too deeply or points into itself".into())
        }
        Some(sig) => ChildFault::Crashed(format!("signal {sig}")),
        None => ChildFault::Crashed(format!("exit status {}", status.code().unwrap_or(-1))),
    }
}

/// The child: reads a PDF from standard input, answers one JSON object on standard output
/// (`smolchat extract`). Returns the exit status: 0 with an answer, 2 when standard input or
/// output failed.
pub fn child_main(caps: PdfCaps) -> i32 {
    // The stack-overflow message Rust prints before aborting is the one line the parent reads
    // from stderr; a panic's backtrace would add nothing but noise.
    std::panic::set_hook(Box::new(|_| {}));
    let mut input = Vec::new();
    if std::io::stdin().read_to_end(&mut input).is_err() {
        return 2;
    }
    let answer = match files::read_pdf(&input, caps) {
        Ok(text) => ChildAnswer::Text(text),
        Err(refusal) => ChildAnswer::Refused(refusal.to_string()),
    };
    let mut stdout = std::io::stdout().lock();
    match serde_json::to_writer(&mut stdout, &answer) {
        Ok(()) if stdout.flush().is_ok() => 0,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config whose child is `sh -c SCRIPT`: the parent's handling of every way a child can
    /// end, with real processes.
    fn shell(script: &str) -> SandboxConfig {
        SandboxConfig {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into(), "sh".into()],
            memory_bytes: 256 << 20,
            cpu_seconds: 5,
            timeout: Duration::from_millis(1500),
            stack_bytes: 8 << 20,
            caps: PdfCaps {
                max_inflated_bytes: 1 << 20,
                max_text_bytes: 1 << 10,
            },
            concurrent: 2,
            concurrent_per_owner: 1,
        }
    }

    const CAPS: PdfCaps = PdfCaps {
        max_inflated_bytes: 1 << 20,
        max_text_bytes: 1 << 10,
    };

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    #[test]
    fn a_childs_answer_is_read() {
        let cfg = shell(r#"cat >/dev/null; printf '{"text":"hello"}'"#);
        let got = rt().block_on(run_child(&cfg, cfg.caps, b"%PDF-1.4".to_vec()));
        assert_eq!(got.ok(), Some(ChildAnswer::Text("hello".into())));
        let cfg = shell(r#"cat >/dev/null; printf '{"refused":"no text"}'"#);
        let got = rt().block_on(run_child(&cfg, cfg.caps, b"%PDF-1.4".to_vec()));
        assert_eq!(got.ok(), Some(ChildAnswer::Refused("no text".into())));
    }

    #[test]
    fn a_crash_a_hang_and_a_flood_are_faults_not_answers() {
        let got = rt().block_on(run_child(
            &shell("kill -SEGV $$"),
            CAPS,
            vec![b'x'; 100_000],
        ));
        assert!(matches!(got, Err(ChildFault::Crashed(_))), "{got:?}");
        let started = std::time::Instant::now();
        let got = rt().block_on(run_child(&shell("sleep 30"), CAPS, b"x".to_vec()));
        assert!(matches!(got, Err(ChildFault::Timeout(_))), "{got:?}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the child was not killed"
        );
        let got = rt().block_on(run_child(&shell("yes x"), CAPS, b"x".to_vec()));
        assert!(matches!(got, Err(ChildFault::TooMuchOutput(_))), "{got:?}");
        let got = rt().block_on(run_child(&shell("echo not json"), CAPS, b"x".to_vec()));
        assert!(matches!(got, Err(ChildFault::NoAnswer(_))), "{got:?}");
        let mut cfg = shell("exit 0");
        cfg.program = "/nonexistent/smolchat".into();
        let got = rt().block_on(run_child(&cfg, cfg.caps, b"x".to_vec()));
        assert!(matches!(got, Err(ChildFault::Spawn(_))), "{got:?}");
    }

    #[test]
    fn the_child_runs_under_its_limits() {
        // The shell reports the limits it was started with.
        let cfg =
            shell(r#"printf '{"text":"%s %s %s"}' "$(ulimit -d)" "$(ulimit -c)" "$(ulimit -f)""#);
        let got = rt().block_on(run_child(&cfg, cfg.caps, Vec::new()));
        assert_eq!(
            got.ok(),
            Some(ChildAnswer::Text(format!("{} 0 0", (256u64 << 20) / 1024)))
        );
        // Nothing of the parent's environment reaches it.
        std::env::set_var("SMOLCHAT_SANDBOX_TEST_SECRET", "s3cret");
        let cfg = shell(r#"printf '{"text":"%s"}' "${SMOLCHAT_SANDBOX_TEST_SECRET:-unset}""#);
        let got = rt().block_on(run_child(&cfg, cfg.caps, Vec::new()));
        assert_eq!(got.ok(), Some(ChildAnswer::Text("unset".into())));
    }

    #[test]
    fn places_are_bounded_per_owner_and_in_all_and_given_back() {
        let reader = DocumentReader::new(shell("exit 0"), 16);
        let a = reader.take_place("alice").ok();
        assert!(a.is_some());
        assert!(
            matches!(reader.take_place("alice"), Err(ReadError::Busy { .. })),
            "one owner, one place"
        );
        let b = reader.take_place("bob").ok();
        assert!(b.is_some());
        let e = reader.take_place("carol").err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("limits.max_concurrent_extractions")),
            "{e:?}"
        );
        drop(a);
        assert!(reader.take_place("carol").is_ok(), "a place given back");
    }
}
