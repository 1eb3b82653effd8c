//! Ids back to text: every token's bytes are computed once (GPT-2's byte-level map undone), so
//! decoding is a table lookup and a stream never splits a character.

use std::fmt;
use std::sync::{Arc, LazyLock};

use super::vocab::TokenKind;
use super::Tokenizer;

/// GPT-2's reversible byte → char map: printable bytes stand for themselves, the others are
/// shifted to U+0100 and up so that every token is printable text.
fn byte_level_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[usize::from(b)] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
    }
    map
}

/// The inverse map, indexed by code point (all of them are below U+0144).
static CHAR_TO_BYTE: LazyLock<Vec<Option<u8>>> = LazyLock::new(|| {
    let mut inv = vec![None; 0x144];
    for (b, c) in byte_level_chars().iter().enumerate() {
        if let Some(slot) = inv.get_mut(*c as usize) {
            *slot = u8::try_from(b).ok();
        }
    }
    inv
});

/// The bytes a byte-level token stands for. A char outside the byte alphabet (which a sound
/// vocabulary never has) is kept as its own UTF-8 rather than dropped.
fn byte_level_decode(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match CHAR_TO_BYTE.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

/// `<0xAB>` → 0xAB, for BYTE-typed tokens.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Every token's raw bytes, in one buffer: `bytes[offsets[id]..offsets[id + 1]]`.
pub(super) struct Pieces {
    bytes: Vec<u8>,
    offsets: Vec<usize>,
}

impl Pieces {
    pub(super) fn build<'a>(tokens: impl ExactSizeIterator<Item = (TokenKind, &'a str)>) -> Self {
        let mut bytes = Vec::with_capacity(tokens.len() * 8);
        let mut offsets = Vec::with_capacity(tokens.len() + 1);
        offsets.push(0);
        for (kind, text) in tokens {
            // What llama.cpp's token_to_piece renders with special = true.
            match kind {
                TokenKind::Normal => byte_level_decode(text, &mut bytes),
                TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined => {
                    bytes.extend_from_slice(text.as_bytes())
                }
                TokenKind::Byte => bytes.extend(parse_byte_token(text)),
                TokenKind::Unused | TokenKind::Undefined => {}
            }
            offsets.push(bytes.len());
        }
        Self { bytes, offsets }
    }

    pub(super) fn get(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => self.bytes.get(a..b).unwrap_or_default(),
            _ => &[],
        }
    }

    fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }
}

/// Incremental detokenization for streaming: each [`Detokenizer::push`] returns the text that
/// became complete, holding back the bytes of a character that a later token finishes (emoji and
/// CJK characters are often split over byte-level tokens). The concatenation of everything
/// returned, plus [`Detokenizer::finish`], equals [`Tokenizer::decode`] of all ids.
#[derive(Clone)]
pub struct Detokenizer {
    pieces: Arc<Pieces>,
    pending: Vec<u8>,
}

impl fmt::Debug for Detokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detokenizer")
            .field("vocab_size", &self.pieces.len())
            .field("pending", &self.pending)
            .finish()
    }
}

impl Detokenizer {
    pub fn new(tokenizer: &Tokenizer) -> Self {
        Self {
            pieces: Arc::clone(&tokenizer.pieces),
            pending: Vec::with_capacity(8),
        }
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.pending.extend_from_slice(self.pieces.get(id));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // A character still waiting for its last bytes: keep them.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        // Bytes no continuation can repair: one U+FFFD per bad sequence, the
                        // same as `String::from_utf8_lossy` over the whole output.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        out
    }

    /// Flushes what is held back; an unfinished character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection() {
        let chars = byte_level_chars();
        let mut seen = std::collections::HashSet::new();
        for (b, c) in chars.iter().enumerate() {
            assert!(seen.insert(*c));
            assert_eq!(CHAR_TO_BYTE[*c as usize], Some(b as u8));
        }
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x0>"), None);
    }
}
