//! Tokens and credential checks.
//!
//! A session token is 32 random bytes written as 64 lowercase hex characters (URL- and
//! cookie-safe). The database keeps only its SHA-256 ([`session_id`]), so reading the database
//! does not yield a usable cookie.
//!
//! Credentials (the admin token) are compared as SHA-256 digests with [`subtle`]'s constant-time
//! equality: both sides are always 32 bytes, so neither the comparison's time nor an early exit
//! on a length mismatch says anything about the secret's length or how much of a guess was right.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Bytes of randomness in a session token.
pub const TOKEN_BYTES: usize = 32;
/// Characters of a session token as written in a cookie (hex).
pub const TOKEN_CHARS: usize = TOKEN_BYTES * 2;

/// `bytes` as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            // Writing to a String cannot fail.
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A fresh session: the token for the cookie (32 bytes from the thread-local CSPRNG, as hex)
/// and the id the store keeps for it ([`session_id`]).
pub fn new_session() -> (String, String) {
    let bytes: [u8; TOKEN_BYTES] = rand::random();
    let token = hex(&bytes);
    let id = hash_token(&token);
    (token, id)
}

fn hash_token(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

/// The stored id of a session token: its SHA-256 as hex. `None` when `token` is not shaped
/// like one this server makes (64 lowercase hex characters), so junk cookies never reach the
/// database.
pub fn session_id(token: &str) -> Option<String> {
    let shaped = token.len() == TOKEN_CHARS
        && token
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    shaped.then(|| hash_token(token))
}

/// The SHA-256 of a credential, kept in memory to compare guesses against.
pub fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Whether `given` hashes to `expected` ([`digest`]), in constant time over the 32-byte digests.
pub fn matches(given: &str, expected: &[u8; 32]) -> bool {
    let given = digest(given);
    given.ct_eq(expected).into()
}

/// A fingerprint of `credential` under `key`: HMAC-SHA-256 over a purpose label and the
/// credential, as hex. Sessions remember the fingerprint they were made under, so a changed
/// credential ends them. Keyed (with the server's cookie key), so the stored value does not let
/// whoever reads the database test guesses of the credential offline without also having the
/// key.
pub fn fingerprint(key: &[u8], purpose: &str, credential: &str) -> String {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return hex(&Sha256::digest(credential.as_bytes()));
    };
    mac.update(purpose.as_bytes());
    // A separator no purpose label contains, so ("ab", "c") and ("a", "bc") differ.
    mac.update(&[0]);
    mac.update(credential.as_bytes());
    hex(&mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_hex_and_ids_are_their_hashes() {
        let (a, id) = new_session();
        let (b, _) = new_session();
        assert_eq!(a.len(), TOKEN_CHARS);
        assert_ne!(a, b);
        assert_eq!(id.len(), 64);
        assert_ne!(id, a, "the id is not the token");
        assert_eq!(session_id(&a), Some(id));
        assert_ne!(session_id(&a), session_id(&b));
    }

    #[test]
    fn malformed_tokens_have_no_id() {
        let (good, _) = new_session();
        for bad in [
            String::new(),
            "admin-v1".to_string(),
            good[1..].to_string(),
            format!("{good}0"),
            good.to_uppercase(),
            format!("{}g", &good[1..]),
        ] {
            assert_eq!(session_id(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn matches_only_the_exact_secret() {
        let expected = digest("s3cret-admin-token");
        assert!(matches("s3cret-admin-token", &expected));
        for wrong in [
            "",
            "s3cret",
            "s3cret-admin-token-",
            "S3CRET-ADMIN-TOKEN",
            "s3cret-admin-tokeN",
        ] {
            assert!(!matches(wrong, &expected), "{wrong:?}");
        }
    }

    #[test]
    fn fingerprints_depend_on_key_purpose_and_credential() {
        let f = fingerprint(b"key-one", "admin-token", "t");
        assert_eq!(f.len(), 64);
        assert_eq!(f, fingerprint(b"key-one", "admin-token", "t"));
        assert_ne!(f, fingerprint(b"key-two", "admin-token", "t"));
        assert_ne!(f, fingerprint(b"key-one", "admin-token", "u"));
        assert_ne!(f, fingerprint(b"key-one", "password", "t"));
        assert_ne!(
            fingerprint(b"k", "ab", "c"),
            fingerprint(b"k", "a", "bc"),
            "purpose and credential are separated"
        );
    }
}
