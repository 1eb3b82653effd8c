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

/// Checks and reads a file of `bytes` named `name` (at most `limit` bytes). CPU work (a PDF
/// can take a while): call it off the event loop. A PDF the extractor panics on is refused as
/// unreadable, never a crash.
pub fn extract(name: &str, bytes: &[u8], limit: usize) -> Result<Extracted, FileError> {
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
    let unreadable = |reason: String| FileError::Unreadable {
        name: name.clone(),
        kind: kind.what(),
        reason,
    };
    let text = match kind {
        FileKind::Pdf => {
            if !bytes.starts_with(b"%PDF-") {
                return Err(unreadable("it does not start with %PDF-".into()));
            }
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                pdf_extract::extract_text_from_mem(bytes)
            }));
            let text = match result {
                Ok(Ok(text)) => text,
                Ok(Err(e)) => return Err(unreadable(e.to_string())),
                Err(_) => return Err(unreadable("its structure is damaged".into())),
            };
            let text = tidy_pdf_text(&text);
            if text.trim().is_empty() {
                return Err(unreadable(
                    "it holds no text (a scanned image?); attach a PDF with a text layer".into(),
                ));
            }
            text
        }
        _ => {
            let text = std::str::from_utf8(bytes).map_err(|e| {
                unreadable(format!(
                    "byte {} is not UTF-8 (a binary file, or another encoding)",
                    e.valid_up_to()
                ))
            })?;
            if text.contains('\0') {
                return Err(unreadable("it contains NUL bytes (a binary file)".into()));
            }
            if let Some(what) = crate::validation::not_text(text) {
                return Err(unreadable(format!("it contains {what}")));
            }
            if kind == FileKind::Json && !name.to_ascii_lowercase().ends_with("l") {
                serde_json::from_str::<serde::de::IgnoredAny>(text)
                    .map_err(|e| unreadable(format!("it does not parse: {e}")))?;
            }
            text.strip_prefix('\u{feff}').unwrap_or(text).to_string()
        }
    };
    Ok(Extracted {
        kind,
        media_type,
        text,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

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
}
