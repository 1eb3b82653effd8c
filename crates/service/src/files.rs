//! Files in a conversation: which files are accepted, their text as the model reads it, and the
//! one format that places them into a user message. Every interface comes here: the chat page
//! and `POST /api/conversations/{id}/files` (through [`crate::Conversations::upload_file`]),
//! and `/v1/chat/completions` `file` content parts.
//!
//! Accepted: plain text, Markdown, source code, CSV/TSV, JSON (checked to parse) and PDF (text
//! extracted with `pdf-extract`). The type comes from the name's extension and the bytes must
//! agree: an executable (ELF, PE, Mach-O, WebAssembly) is refused whatever its name, and a text
//! kind must be UTF-8 without NUL bytes. A PDF must start with `%PDF-`; one that holds no text
//! (a scan) is refused, since the model could read nothing of it.
//!
//! The prompt format (documented in the README), one block per file before the user's text:
//!
//! ```text
//! <file name="report.pdf" type="pdf">
//! …the file's text…
//! </file>
//!
//! What does the report conclude?
//! ```

use std::panic::AssertUnwindSafe;

/// Why a file is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FileError {
    #[error("{name:?} is {size} bytes; files may be at most {limit} bytes ({} MiB, limits.max_file_mib)", limit / (1 << 20))]
    TooLarge {
        name: String,
        size: usize,
        limit: usize,
    },
    #[error("{name:?} is empty")]
    Empty { name: String },
    #[error("{name:?} is an executable program ({what}); only documents and text can be attached: text, Markdown, source code, CSV, JSON and PDF")]
    Executable { name: String, what: &'static str },
    #[error("{name:?} is not a type that can be attached ({reason}); attach text, Markdown, source code, CSV, JSON or PDF files")]
    UnknownType { name: String, reason: String },
    #[error("{name:?} is not {kind} the server can read: {reason}")]
    Unreadable {
        name: String,
        kind: &'static str,
        reason: String,
    },
    #[error("the file name {0:?} is not usable: {1}")]
    BadName(String, &'static str),
}

/// The kinds of files accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Text,
    Markdown,
    Code,
    Csv,
    Json,
    Pdf,
}

impl FileKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::Text => "text",
            FileKind::Markdown => "markdown",
            FileKind::Code => "code",
            FileKind::Csv => "csv",
            FileKind::Json => "json",
            FileKind::Pdf => "pdf",
        }
    }

    fn what(self) -> &'static str {
        match self {
            FileKind::Pdf => "a PDF",
            FileKind::Json => "JSON",
            _ => "UTF-8 text",
        }
    }
}

/// Source code extensions taken as text of kind `code`.
const CODE_EXTENSIONS: &[&str] = &[
    "rs",
    "py",
    "pyi",
    "js",
    "mjs",
    "cjs",
    "ts",
    "tsx",
    "jsx",
    "c",
    "h",
    "cc",
    "cpp",
    "cxx",
    "hpp",
    "hh",
    "cs",
    "go",
    "java",
    "kt",
    "kts",
    "scala",
    "swift",
    "m",
    "mm",
    "rb",
    "php",
    "pl",
    "pm",
    "lua",
    "r",
    "jl",
    "hs",
    "ml",
    "mli",
    "ex",
    "exs",
    "erl",
    "clj",
    "dart",
    "zig",
    "nim",
    "sh",
    "bash",
    "zsh",
    "fish",
    "ps1",
    "bat",
    "cmd",
    "sql",
    "html",
    "htm",
    "css",
    "scss",
    "sass",
    "less",
    "vue",
    "svelte",
    "xml",
    "svg",
    "yaml",
    "yml",
    "toml",
    "ini",
    "cfg",
    "conf",
    "env",
    "gradle",
    "cmake",
    "mk",
    "make",
    "dockerfile",
    "tf",
    "proto",
    "graphql",
    "gql",
    "tex",
    "bib",
    "diff",
    "patch",
    "asm",
    "s",
    "v",
    "sv",
    "vhd",
    "f90",
    "cu",
    "cuh",
    "metal",
    "glsl",
    "wgsl",
];
/// Names without an extension taken as code.
const CODE_NAMES: &[&str] = &[
    "makefile",
    "dockerfile",
    "containerfile",
    "justfile",
    "gemfile",
    "rakefile",
    "cmakelists.txt",
];

/// The kind a file name says, or why it is not accepted.
fn kind_of_name(name: &str) -> Result<(FileKind, &'static str), String> {
    let lower = name.to_ascii_lowercase();
    if CODE_NAMES.contains(&lower.as_str()) {
        return Ok((FileKind::Code, "text/plain"));
    }
    let Some((_, ext)) = lower.rsplit_once('.') else {
        return Err("it has no extension".into());
    };
    Ok(match ext {
        "txt" | "text" | "log" | "rst" | "org" | "adoc" => (FileKind::Text, "text/plain"),
        "md" | "markdown" | "mdx" => (FileKind::Markdown, "text/markdown"),
        "csv" => (FileKind::Csv, "text/csv"),
        "tsv" => (FileKind::Csv, "text/tab-separated-values"),
        "json" | "jsonl" | "ndjson" | "geojson" => (FileKind::Json, "application/json"),
        "pdf" => (FileKind::Pdf, "application/pdf"),
        e if CODE_EXTENSIONS.contains(&e) => (FileKind::Code, "text/plain"),
        e @ ("exe" | "dll" | "so" | "dylib" | "bin" | "elf" | "app" | "msi" | "com" | "scr"
        | "apk" | "jar" | "class" | "wasm" | "o" | "a" | "lib" | "out") => {
            return Err(format!(".{e} files are programs or libraries"))
        }
        e => return Err(format!(".{e} is not one of the accepted extensions")),
    })
}

/// What program format `bytes` start with, if any.
fn executable_magic(bytes: &[u8]) -> Option<&'static str> {
    let starts = |m: &[u8]| bytes.starts_with(m);
    if starts(b"\x7fELF") {
        Some("an ELF binary")
    } else if starts(b"MZ") {
        Some("a Windows PE/DOS executable")
    } else if starts(&[0xfe, 0xed, 0xfa, 0xce])
        || starts(&[0xfe, 0xed, 0xfa, 0xcf])
        || starts(&[0xce, 0xfa, 0xed, 0xfe])
        || starts(&[0xcf, 0xfa, 0xed, 0xfe])
        || starts(&[0xca, 0xfe, 0xba, 0xbe])
    {
        Some("a Mach-O binary")
    } else if starts(b"\0asm") {
        Some("a WebAssembly module")
    } else {
        None
    }
}

/// A file accepted: its kind, media type and the text the model reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Extracted {
    pub kind: FileKind,
    pub media_type: &'static str,
    pub text: String,
}

/// The characters that change the direction text is shown in.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

/// Checks a file name: what the pages and the prompt show. Returns it trimmed.
pub fn check_name(name: &str) -> Result<String, FileError> {
    let trimmed = name.trim();
    if trimmed.is_empty() {
        return Err(FileError::BadName(name.into(), "it is empty"));
    }
    if trimmed.chars().count() > 255 {
        return Err(FileError::BadName(
            trimmed.chars().take(40).collect(),
            "it is longer than 255 characters",
        ));
    }
    if trimmed.chars().any(|c| c.is_control() || c == '"') {
        return Err(FileError::BadName(
            trimmed.into(),
            "it contains a control character or a double quote",
        ));
    }
    // Bidirectional controls make a name read other than it is (`report\u{202e}fdp.exe` shows
    // as `reportexe.pdf`).
    if trimmed.chars().any(is_bidi_control) {
        return Err(FileError::BadName(
            trimmed.chars().filter(|c| !is_bidi_control(*c)).collect(),
            "it contains a bidirectional text control (U+202A–U+202E, U+2066–U+2069, U+200E, \
             U+200F or U+061C), which would make it display as another name; rename the file",
        ));
    }
    // A path's last part: browsers send bare names, other clients may send more.
    let base = trimmed
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or(trimmed)
        .to_string();
    if base.is_empty() {
        return Err(FileError::BadName(name.into(), "it names a folder"));
    }
    Ok(base)
}

/// What a file's name and first bytes say, checked: its name (trimmed to the last part), kind
/// and media type. Cheap; refuses before anything reads the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub name: String,
    pub kind: FileKind,
    pub media_type: &'static str,
}

/// Checks a file of `bytes` named `name` (at most `limit` bytes) before it is read: the name, the
/// size, program formats and the accepted types.
pub fn check(name: &str, bytes: &[u8], limit: usize) -> Result<Checked, FileError> {
    let name = check_name(name)?;
    if bytes.len() > limit {
        return Err(FileError::TooLarge {
            name,
            size: bytes.len(),
            limit,
        });
    }
    if let Some(what) = executable_magic(bytes) {
        return Err(FileError::Executable { name, what });
    }
    let (kind, media_type) = kind_of_name(&name).map_err(|reason| FileError::UnknownType {
        name: name.clone(),
        reason,
    })?;
    if bytes.is_empty() {
        return Err(FileError::Empty { name });
    }
    if kind == FileKind::Pdf && !bytes.starts_with(b"%PDF-") {
        return Err(FileError::Unreadable {
            name,
            kind: kind.what(),
            reason: "it does not start with %PDF-".into(),
        });
    }
    Ok(Checked {
        name,
        kind,
        media_type,
    })
}

impl Checked {
    /// The error for this file when its contents cannot be read.
    pub fn unreadable(&self, reason: impl Into<String>) -> FileError {
        FileError::Unreadable {
            name: self.name.clone(),
            kind: self.kind.what(),
            reason: reason.into(),
        }
    }
}

/// The text of a checked file of a text kind (everything but PDF): UTF-8 without NUL bytes or
/// other binary content, JSON that parses. Linear in the file's size and bounded by it; a PDF
/// is read by [`crate::documents::DocumentReader`] in a child process instead.
pub fn read_text(file: &Checked, bytes: &[u8]) -> Result<String, FileError> {
    debug_assert!(file.kind != FileKind::Pdf);
    let text = std::str::from_utf8(bytes).map_err(|e| {
        file.unreadable(format!(
            "byte {} is not UTF-8 (a binary file, or another encoding)",
            e.valid_up_to()
        ))
    })?;
    if text.contains('\0') {
        return Err(file.unreadable("it contains NUL bytes (a binary file)"));
    }
    if let Some(what) = crate::validation::not_text(text) {
        return Err(file.unreadable(format!("it contains {what}")));
    }
    if file.kind == FileKind::Json && !file.name.to_ascii_lowercase().ends_with('l') {
        serde_json::from_str::<serde::de::IgnoredAny>(text)
            .map_err(|e| file.unreadable(format!("it does not parse: {e}")))?;
    }
    Ok(text.strip_prefix('\u{feff}').unwrap_or(text).to_string())
}

/// Bounds on reading one PDF: how many bytes its compressed streams may inflate to and how much
/// text it may give. Reading stops at either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdfCaps {
    pub max_inflated_bytes: usize,
    pub max_text_bytes: usize,
}

/// Why a PDF's text could not be read (the reason a user is shown).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PdfRefusal {
    #[error("its structure is damaged: {0}")]
    Damaged(String),
    #[error("its compressed streams inflate to more than {} MiB (a decompression bomb?)", .0 >> 20)]
    Inflates(usize),
    #[error("its text runs past {} KiB, more than the conversation can hold: attach a shorter part of it", .0 >> 10)]
    TextTooLong(usize),
    #[error("it holds no text (a scanned image?); attach a PDF with a text layer")]
    NoText,
    #[error("it is encrypted with a password; attach an unprotected copy")]
    Encrypted,
}

/// Reads a PDF's text, in this process. Only the sandboxed child (`smolchat extract`) may call
/// it: parsing a hostile PDF can recurse without bound (a stack overflow no `catch_unwind`
/// catches) or allocate without bound; see [`crate::documents`].
pub fn read_pdf(bytes: &[u8], caps: PdfCaps) -> Result<String, PdfRefusal> {
    let mut doc = std::panic::catch_unwind(AssertUnwindSafe(|| lopdf::Document::load_mem(bytes)))
        .map_err(|_| PdfRefusal::Damaged("the parser gave up".into()))?
        .map_err(|e| PdfRefusal::Damaged(e.to_string()))?;
    if doc.is_encrypted() && doc.decrypt("").is_err() {
        return Err(PdfRefusal::Encrypted);
    }
    check_inflated_size(&doc, caps.max_inflated_bytes)?;
    let mut out = CappedText {
        text: Vec::new(),
        cap: caps.max_text_bytes,
        over: false,
    };
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut plain = pdf_extract::PlainTextOutput::new(&mut out as &mut dyn std::io::Write);
        pdf_extract::output_doc(&doc, &mut plain)
    }));
    if out.over {
        return Err(PdfRefusal::TextTooLong(caps.max_text_bytes));
    }
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(PdfRefusal::Damaged(e.to_string())),
        Err(_) => {
            return Err(PdfRefusal::Damaged(
                "the text layer could not be followed".into(),
            ))
        }
    }
    let text = tidy_pdf_text(&String::from_utf8_lossy(&out.text));
    if text.trim().is_empty() {
        return Err(PdfRefusal::NoText);
    }
    Ok(text)
}

/// Refuses a document whose Flate streams, images aside (text extraction never decodes them),
/// inflate to more than `cap` bytes in all, counting as it inflates and stopping at the cap.
fn check_inflated_size(doc: &lopdf::Document, cap: usize) -> Result<(), PdfRefusal> {
    use std::io::Read;
    let mut total: usize = 0;
    for object in doc.objects.values() {
        let Ok(stream) = object.as_stream() else {
            continue;
        };
        let is_image = stream
            .dict
            .get(b"Subtype")
            .and_then(|s| s.as_name())
            .is_ok_and(|s| s == b"Image");
        let flate = stream
            .filters()
            .is_ok_and(|f| f.first().is_some_and(|f| *f == b"FlateDecode"));
        if is_image || !flate {
            continue;
        }
        let left = cap.saturating_sub(total);
        let mut inflater =
            flate2::read::ZlibDecoder::new(stream.content.as_slice()).take(left as u64 + 1);
        // A stream that stops inflating early (damaged) counts what it gave.
        let n = std::io::copy(&mut inflater, &mut std::io::sink()).unwrap_or(0) as usize;
        total = total.saturating_add(n);
        if total > cap {
            return Err(PdfRefusal::Inflates(cap));
        }
    }
    Ok(())
}

/// A writer that takes at most `cap` bytes, then fails (which stops the extractor) and says so.
struct CappedText {
    text: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for CappedText {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("the text cap is reached"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A PDF's extracted text without its runs of blank lines and trailing spaces.
fn tidy_pdf_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut blank = 0;
    for line in text.lines() {
        let line = line.trim_end();
        if line.is_empty() {
            blank += 1;
            if blank > 1 {
                continue;
            }
        } else {
            blank = 0;
        }
        out.push_str(line);
        out.push('\n');
    }
    out.trim().to_string()
}

/// A token count that stopped early or ran through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCount {
    /// The text's tokens, at most the room.
    Within(usize),
    /// The text has more tokens than the room: at least this many (counting stopped there).
    Over { at_least: usize },
}

/// Bytes tokenized at a time by [`count_tokens_within`].
const COUNT_CHUNK_BYTES: usize = 64 << 10;

/// Counts `text`'s tokens, stopping as soon as the count passes `room`. First by bytes: no token
/// is longer than `longest_token_bytes`, so a text of more than `room` times that many bytes is
/// over without tokenizing at all. Then in chunks of about 64 KiB cut after a line break (or a
/// space): memory stays bounded by the chunk, and a file far over the room costs one chunk past
/// it. A cut between lines can only change how the pieces beside it merge, so the sum may
/// differ from one whole tokenization by a token or two a chunk; the room keeps margin for that.
pub fn count_tokens_within(
    tokenizer: &smolchat_text::tokenizer::Tokenizer,
    text: &str,
    room: usize,
    longest_token_bytes: usize,
) -> Result<TokenCount, smolchat_text::TextError> {
    let at_least = text.len().div_ceil(longest_token_bytes.max(1));
    if at_least > room {
        return Ok(TokenCount::Over { at_least });
    }
    let mut total = 0usize;
    let mut rest = text;
    while !rest.is_empty() {
        let cut = chunk_end(rest, COUNT_CHUNK_BYTES);
        let (chunk, tail) = rest.split_at(cut);
        total += tokenizer.encode(chunk, false)?.len();
        if total > room {
            return Ok(TokenCount::Over { at_least: total });
        }
        rest = tail;
    }
    Ok(TokenCount::Within(total))
}

/// Where a chunk of about `max` bytes of `text` ends: after the last line break in it, else
/// after the last space, else at a character boundary; all of `text` when it is short.
fn chunk_end(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let window = &text[..end];
    let at = window
        .rfind('\n')
        .or_else(|| window.rfind(' '))
        .map(|i| i + 1)
        .filter(|&i| i > max / 2);
    at.unwrap_or(end)
}

/// One file as the prompt shows it.
#[derive(Debug, Clone, Copy)]
pub struct FileText<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub text: &'a str,
}

/// A file's block in the prompt (see the module documentation).
pub fn file_block(file: FileText<'_>) -> String {
    let mut block = format!("<file name=\"{}\" type=\"{}\">\n", file.name, file.kind);
    block.push_str(file.text.trim_end_matches('\n'));
    block.push_str("\n</file>");
    block
}

/// A user message with its files placed in it: each file's block, then the text. The one
/// format every interface uses.
pub fn message_with_files(files: &[FileText<'_>], text: &str) -> String {
    if files.is_empty() {
        return text.to_string();
    }
    let mut out = String::new();
    for f in files {
        out.push_str(&file_block(*f));
        out.push_str("\n\n");
    }
    out.push_str(text);
    out
}

/// The PDF writer the integration tests use too (`tests/common/pdf.rs`), one copy for both.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../../tests/common/pdf.rs"]
mod test_pdf;

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;
    const CAPS: PdfCaps = PdfCaps {
        max_inflated_bytes: 4 * MB,
        max_text_bytes: MB,
    };

    /// Checks and reads a file in this process, the way the server reads it (a PDF in its
    /// child process: [`crate::documents`]).
    fn extract(name: &str, bytes: &[u8], limit: usize) -> Result<Extracted, FileError> {
        let c = check(name, bytes, limit)?;
        let text = if c.kind == FileKind::Pdf {
            read_pdf(bytes, CAPS).map_err(|r| c.unreadable(r.to_string()))?
        } else {
            read_text(&c, bytes)?
        };
        Ok(Extracted {
            kind: c.kind,
            media_type: c.media_type,
            text,
        })
    }

    #[test]
    fn text_kinds_are_read_and_checked() {
        let csv = extract("data.csv", b"a,b\n1,2\n", MB).unwrap();
        assert_eq!((csv.kind, csv.text.as_str()), (FileKind::Csv, "a,b\n1,2\n"));
        assert_eq!(
            extract("main.rs", b"fn main() {}", MB).unwrap().kind,
            FileKind::Code
        );
        assert_eq!(
            extract("Makefile", b"all:\n", MB).unwrap().kind,
            FileKind::Code
        );
        assert_eq!(
            extract("notes.md", b"# hi", MB).unwrap().kind,
            FileKind::Markdown
        );
        assert_eq!(
            extract("x.json", b"{\"a\": 1}", MB).unwrap().kind,
            FileKind::Json
        );
        assert!(matches!(
            extract("x.json", b"{\"a\": ", MB),
            Err(FileError::Unreadable { .. })
        ));
        // A BOM is not text the model needs.
        assert_eq!(extract("a.txt", b"\xef\xbb\xbfhi", MB).unwrap().text, "hi");
        assert!(matches!(
            extract("a.txt", b"\xff\xfe", MB),
            Err(FileError::Unreadable { .. })
        ));
        assert!(matches!(
            extract("a.txt", b"a\0b", MB),
            Err(FileError::Unreadable { .. })
        ));
        assert!(matches!(
            extract("a.txt", b"", MB),
            Err(FileError::Empty { .. })
        ));
    }

    #[test]
    fn programs_and_unknown_types_are_refused_saying_why() {
        for (name, bytes) in [
            ("tool", &b"\x7fELF\x02\x01\x01"[..]),
            ("notes.txt", &b"\x7fELF\x02\x01\x01"[..]),
            ("setup.exe", &b"MZ\x90\0"[..]),
            ("lib.wasm", &b"\0asm\x01\0\0\0"[..]),
        ] {
            let e = extract(name, bytes, MB).unwrap_err();
            assert!(matches!(e, FileError::Executable { .. }), "{name}: {e}");
            assert!(e.to_string().contains("executable"), "{e}");
        }
        let e = extract("photo.jpg", b"\xff\xd8\xff", MB).unwrap_err();
        assert!(matches!(e, FileError::UnknownType { .. }), "{e}");
        assert!(e.to_string().contains(".jpg"), "{e}");
        let e = extract("run.exe", b"not really", MB).unwrap_err();
        assert!(e.to_string().contains("programs"), "{e}");
        let e = extract("big.txt", &[b'a'; 11], 10).unwrap_err();
        assert!(matches!(e, FileError::TooLarge { size: 11, .. }), "{e}");
    }

    #[test]
    fn names_are_their_last_part_and_plain() {
        assert_eq!(check_name(" dir/sub\\report.pdf ").unwrap(), "report.pdf");
        assert!(check_name("a\"b.txt").is_err());
        assert!(check_name("a\nb.txt").is_err());
        assert!(check_name("dir/").is_err());
        let e = check_name("report\u{202e}fdp.exe").unwrap_err().to_string();
        assert!(e.contains("bidirectional"), "{e}");
        assert!(check_name("a\u{2067}b.txt").is_err());
        assert!(check_name("").is_err());
    }

    #[test]
    fn a_pdf_gives_its_text() {
        let pdf = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/files/report.pdf"
        ))
        .expect("tests/data/files/report.pdf (scripts/make-test-pdf.py)");
        let got = extract("report.pdf", &pdf, MB).unwrap();
        assert_eq!(got.kind, FileKind::Pdf);
        assert!(
            got.text.contains("Revenue grew by 17 percent"),
            "{}",
            got.text
        );
        assert!(got.text.contains("PAPAYA-42"), "second page: {}", got.text);
    }

    #[test]
    fn damaged_pdfs_are_refused_not_crashes() {
        for bytes in [
            &b"%PDF-1.4\n garbage"[..],
            &b"%PDF-1.7\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF"[..],
            &b"not a pdf at all"[..],
        ] {
            let e = extract("x.pdf", bytes, MB).unwrap_err();
            assert!(matches!(e, FileError::Unreadable { .. }), "{e}");
        }
    }

    #[test]
    fn files_go_before_the_text_in_blocks() {
        let files = [
            FileText {
                name: "a.csv",
                kind: "csv",
                text: "x,y\n1,2\n",
            },
            FileText {
                name: "b.rs",
                kind: "code",
                text: "fn f() {}",
            },
        ];
        assert_eq!(
            message_with_files(&files, "Compare them."),
            "<file name=\"a.csv\" type=\"csv\">\nx,y\n1,2\n</file>\n\n\
             <file name=\"b.rs\" type=\"code\">\nfn f() {}\n</file>\n\nCompare them."
        );
        assert_eq!(message_with_files(&[], "Just text."), "Just text.");
    }

    /// A one-page PDF whose content stream is `content`, Flate-compressed, Helvetica as `/F1`.
    fn pdf_with_content(content: &[u8]) -> Vec<u8> {
        test_pdf::one_page(content, true, "", &[])
    }

    #[test]
    fn a_pdf_made_here_reads_and_its_caps_hold() {
        let ok = pdf_with_content(b"BT /F1 12 Tf 72 720 Td (Hello sandbox) Tj ET");
        assert_eq!(read_pdf(&ok, CAPS).unwrap(), "Hello sandbox");
        // A stream that inflates past the cap is refused before any text is extracted.
        let mut bomb = b"BT /F1 12 Tf 72 720 Td (x) Tj ET\n".to_vec();
        bomb.resize(5 * MB, b' ');
        let bomb = pdf_with_content(&bomb);
        assert!(bomb.len() < 64 << 10, "{} bytes", bomb.len());
        assert_eq!(read_pdf(&bomb, CAPS), Err(PdfRefusal::Inflates(4 * MB)));
        // Text past its cap stops the extractor.
        let long: Vec<u8> = (0..40_000)
            .flat_map(|i| {
                format!(
                    "BT /F1 12 Tf 72 {} Td (line of words {i}) Tj ET\n",
                    720 - i % 700
                )
                .into_bytes()
            })
            .collect();
        let caps = PdfCaps {
            max_inflated_bytes: 16 * MB,
            max_text_bytes: 64 << 10,
        };
        assert_eq!(
            read_pdf(&pdf_with_content(&long), caps),
            Err(PdfRefusal::TextTooLong(64 << 10))
        );
    }

    #[test]
    fn chunks_end_after_a_line_or_a_space_on_a_character_boundary() {
        assert_eq!(chunk_end("short", 10), 5);
        assert_eq!(chunk_end("aaaaaa\nbbbbbbbbbb", 10), 7);
        assert_eq!(chunk_end("aaaaaa bbbbbbbbbb", 10), 7);
        // A break in the window's first half would make small chunks: cut at the end instead.
        assert_eq!(chunk_end("aa\nbbbbbbbbbbbbbb", 10), 10);
        assert_eq!(chunk_end("aaaaaaaaaaaaaaa", 10), 10);
        // 'é' is two bytes: a cut inside it moves back.
        let s = "ééééééééé";
        let end = chunk_end(s, 9);
        assert!(s.is_char_boundary(end) && end == 8, "{end}");
    }
}
