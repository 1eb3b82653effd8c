//! Secrets the server generates for itself and keeps in its data folder, so that a restart does
//! not invalidate what was signed before it (owner cookies: a browser that loses its cookie's
//! validity loses its conversations).
//!
//! The file is created once with owner-only permissions and never rewritten; several processes
//! starting together agree on one value because creation is exclusive (`create_new`) and the
//! losers read the winner's file.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

/// The generated cookie secret's file name inside the data folder.
pub const COOKIE_SECRET_FILE: &str = "cookie_secret";

/// Bytes of randomness in a generated secret (written as twice as many hex characters, which
/// satisfies the cookie key's 64-byte minimum).
const SECRET_BYTES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot {action} {path}: {source} (fix the folder's permissions, or set server.cookie_secret)")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} holds {len} bytes of secret; at least 64 are needed. Delete the file to have a new one generated (everyone signed in by cookie starts over), or set server.cookie_secret")]
    TooShort { path: PathBuf, len: usize },
}

/// Reads `dir/name`, creating it with a fresh random secret (mode 0600) when it does not exist.
pub fn load_or_create(dir: &Path, name: &str) -> Result<String, SecretError> {
    let path = dir.join(name);
    let io = |action, source| SecretError::Io {
        action,
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io("create the folder of", e))?;
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    match options.open(&path) {
        Ok(mut file) => {
            let secret = random_secret();
            file.write_all(secret.as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(|e| io("write", e))?;
            tracing::info!(path = %path.display(), "generated a cookie secret (kept across restarts)");
            Ok(secret)
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            let mut secret = String::new();
            std::fs::File::open(&path)
                .and_then(|mut f| f.read_to_string(&mut secret))
                .map_err(|e| io("read", e))?;
            let secret = secret.trim().to_string();
            if secret.len() < SECRET_BYTES {
                return Err(SecretError::TooShort {
                    path,
                    len: secret.len(),
                });
            }
            Ok(secret)
        }
        Err(e) => Err(io("create", e)),
    }
}

/// A fresh random secret as hex (for a database in memory, where nothing can be kept).
pub fn random_secret() -> String {
    let bytes: [u8; SECRET_BYTES] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_then_read_back_with_owner_only_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path(), COOKIE_SECRET_FILE).unwrap();
        assert_eq!(first.len(), 2 * SECRET_BYTES);
        let again = load_or_create(dir.path(), COOKIE_SECRET_FILE).unwrap();
        assert_eq!(first, again);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(COOKIE_SECRET_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            first,
            load_or_create(other.path(), COOKIE_SECRET_FILE).unwrap()
        );
    }

    #[test]
    fn a_truncated_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(COOKIE_SECRET_FILE), "short\n").unwrap();
        let err = load_or_create(dir.path(), COOKIE_SECRET_FILE).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("5 bytes") && msg.contains("Delete the file"),
            "{msg}"
        );
    }
}
