//! The tokenizer, built from the GGUF file's own metadata so that one file is all a user needs.
//!
//! The byte-level BPE itself (pre-tokenizer regexes, byte↔char mapping, merges) is the `tokenizers`
//! crate's. Around it we do, ourselves, the two things whose exact behaviour must match llama.cpp:
//!
//! * Special tokens. llama.cpp cuts the text on special tokens *before* BPE, taking the longest
//!   special token first over the whole text, and it always cuts on user-defined tokens but on
//!   control tokens only when special-token parsing is on. The `tokenizers` crate's added-token
//!   matcher is leftmost-longest and can only switch special parsing through `&mut self`, so we
//!   keep the list ourselves (see [`Tokenizer::encode`]).
//! * Detokenization. Every token's raw bytes are precomputed once (byte-level tokens decoded,
//!   special tokens as their text), so decoding is a table lookup and streaming is exact.
//!
//! The pre-tokenizer regexes are not stored in GGUF files; `tokenizer.ggml.pre` names them and the
//! patterns in `pre.rs` are llama.cpp's (`src/llama-vocab.cpp`) for the names we support.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use aho_corasick::AhoCorasick;
use tokenizers::{
    Model, ModelWrapper, NormalizedString, Normalizer, NormalizerWrapper, OffsetReferential,
    OffsetType, PreTokenizedString, PreTokenizer, PreTokenizerWrapper,
};

use super::guard::{RenderedPrompt, TextGuard};
use crate::error::{Result, TextError};

mod decode;
mod load;
mod pre;
mod vocab;

pub use decode::Detokenizer;
use decode::Pieces;
pub use pre::LLAMA3_PATTERN;
use vocab::TokenKind;

/// A token cut out of the text before BPE.
#[derive(Clone, Debug)]
struct Special {
    id: u32,
    text: String,
    /// Cut even when special-token parsing is off (user-defined tokens, as in llama.cpp and HF).
    always: bool,
    /// Strip ASCII whitespace on that side of the token (tokenizer.json `lstrip`/`rstrip`).
    lstrip: bool,
    rstrip: bool,
}

/// A piece of the input after special tokens are cut out: byte range of text, or a token.
#[derive(Clone, Copy, Debug)]
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

/// Whitespace as C's `isspace` sees it, which is what llama.cpp strips next to special tokens.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// Text ↔ token ids for one model.
pub struct Tokenizer {
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: Option<PreTokenizerWrapper>,
    model: ModelWrapper,
    pieces: Arc<Pieces>,
    kinds: Vec<TokenKind>,
    /// Longest text first, the order in which llama.cpp cuts them out.
    specials: Vec<Special>,
    /// Finds, in one pass, which specials occur at all, so a prompt is scanned once rather than
    /// once per special token (Llama-3-style vocabularies have 256 of them).
    special_finder: Option<AhoCorasick>,
    special_ids: HashMap<String, u32>,
    /// Keeps untrusted text in rendered prompts from being cut as special tokens.
    guard: TextGuard,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    origin: String,
    /// The constrained-decoding parser factory over this vocabulary, built on first use.
    grammar: std::sync::OnceLock<std::result::Result<Arc<llguidance::ParserFactory>, String>>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .field("specials", &self.specials.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

fn tok_err(context: &str) -> impl Fn(tokenizers::Error) -> TextError + '_ {
    move |e| TextError::Tokenizer(format!("{context}: {e}"))
}

impl Tokenizer {
    /// Where constrained decoding keeps the parser factory it builds over this vocabulary
    /// (once per tokenizer; see `constraint::factory_for`).
    pub(crate) fn grammar_cache(
        &self,
    ) -> &std::sync::OnceLock<std::result::Result<Arc<llguidance::ParserFactory>, String>> {
        &self.grammar
    }

    /// Text → ids. With `parse_special`, control tokens written in the text (`<|im_start|>`)
    /// become their single ids; without it they are tokenized as plain text. User-defined tokens
    /// are single ids either way. Never adds BOS: callers check [`Tokenizer::add_bos`].
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(start, end) => {
                    if let Some(piece) = text.get(start..end) {
                        self.encode_plain(piece, &mut out)?;
                    }
                }
            }
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`: for each special token, longest first, cut every
    /// occurrence out of the text fragments that remain.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(0, text.len())];
        let Some(finder) = &self.special_finder else {
            return fragments;
        };
        let mut present = vec![false; self.specials.len()];
        for m in finder.find_overlapping_iter(text) {
            if let Some(p) = present.get_mut(m.pattern().as_usize()) {
                *p = true;
            }
        }
        let bytes = text.as_bytes();
        for (special, _) in self
            .specials
            .iter()
            .zip(&present)
            .filter(|(s, &p)| p && (parse_special || s.always))
        {
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut start, end) = fragment else {
                    next.push(fragment);
                    continue;
                };
                loop {
                    // Special texts are valid UTF-8, so a match (and the ASCII stripping next
                    // to it) always falls on char boundaries; `get` never fails in practice.
                    let found = text
                        .get(start..end)
                        .and_then(|s| s.find(special.text.as_str()));
                    let Some(rel) = found else {
                        next.push(Fragment::Text(start, end));
                        break;
                    };
                    let at = start + rel;
                    let mut left_end = at;
                    if special.lstrip {
                        while left_end > start && is_c_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Fragment::Text(start, left_end));
                    }
                    next.push(Fragment::Token(special.id));
                    let mut right = at + special.text.len();
                    if special.rstrip {
                        while right < end && is_c_space(bytes[right]) {
                            right += 1;
                        }
                    }
                    if right >= end {
                        break;
                    }
                    start = right;
                }
            }
            fragments = next;
        }
        fragments
    }

    /// Normalizer (tokenizer.json only) and pre-tokenizer over plain text.
    fn split_words(&self, text: &str) -> Result<PreTokenizedString> {
        let mut pre = match &self.normalizer {
            Some(normalizer) => {
                let mut normalized = NormalizedString::from(text);
                normalizer
                    .normalize(&mut normalized)
                    .map_err(tok_err("normalization failed"))?;
                PreTokenizedString::from(normalized)
            }
            None => PreTokenizedString::from(text),
        };
        if let Some(pre_tokenizer) = &self.pre_tokenizer {
            pre_tokenizer
                .pre_tokenize(&mut pre)
                .map_err(tok_err("pre-tokenization failed"))?;
        }
        Ok(pre)
    }

    /// Plain text (no special tokens) → ids: normalizer, pre-tokenizer, BPE on each piece.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let pre = self.split_words(text)?;
        for (word, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::None) {
            let tokens = self
                .model
                .tokenize(word)
                .map_err(tok_err("BPE tokenization failed"))?;
            out.extend(tokens.iter().map(|t| t.id));
        }
        Ok(())
    }

    /// The pieces the pre-tokenizer cuts plain text into before BPE, as slices of the input
    /// (special tokens are not cut out here). For diagnostics and tests of the split rules.
    pub fn pre_tokenize(&self, text: &str) -> Result<Vec<String>> {
        let pre = self.split_words(text)?;
        Ok(pre
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter_map(|(_, (a, b), _)| text.get(a..b).map(str::to_string))
            .collect())
    }

    /// Encodes a model prompt: BOS first when the model asks for it, special tokens parsed (a
    /// rendered chat template writes them as text). Every caller that feeds text to the model
    /// uses this, so the API, the sessions and the CLI tokenize prompts identically.
    ///
    /// This is for *raw* prompts (`/v1/completions`, `smolchat generate --prompt`), where the
    /// caller writes the markup itself, as llama-server does. Chat prompts go through
    /// [`Tokenizer::encode_rendered`], which keeps the users' text out of the special tokens.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos() {
            ids.extend(self.bos_id());
        }
        ids.extend(self.encode(text, true)?);
        Ok(ids)
    }

    /// Encodes a chat prompt rendered with this tokenizer's [`Tokenizer::text_guard`]: BOS when
    /// the model asks for it, the template's own special tokens as their ids, and everything that
    /// came from messages, tools or template arguments as plain text — `<|im_end|>` typed by a
    /// user is a few ordinary tokens, never the control token. Where no untrusted text holds a
    /// guarded character the ids equal [`Tokenizer::encode_prompt`] of the same text.
    pub fn encode_rendered(&self, prompt: &RenderedPrompt) -> Result<Vec<u32>> {
        let text = prompt.guarded();
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos() {
            ids.extend(self.bos_id());
        }
        for fragment in self.partition(text, true) {
            match fragment {
                Fragment::Token(id) => ids.push(id),
                Fragment::Text(start, end) => {
                    if let Some(piece) = text.get(start..end) {
                        // Restored pieces may hold special-token text the user typed; plain
                        // BPE (no cut at all, user-defined tokens included) keeps it text.
                        self.encode_plain(&self.guard.restore(piece), &mut ids)?;
                    }
                }
            }
        }
        Ok(ids)
    }

    /// The guard that chat templates apply to untrusted text before rendering.
    pub fn text_guard(&self) -> &TextGuard {
        &self.guard
    }

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`, else llama.cpp's
    /// default for the pre-tokenizer). False for SmolLM2 and SmolLM3.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Ids that end generation: EOS, EOT/EOM when declared, and every token whose text is a
    /// known end-of-turn marker such as `<|im_end|>` or `<|endoftext|>` (llama.cpp's heuristic).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The id of a token given its vocabulary text: `"<|im_end|>"`, or a byte-level piece such
    /// as `"Ġthe"`.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.special_ids
            .get(piece)
            .copied()
            .or_else(|| self.model.token_to_id(piece))
    }

    /// Number of ids (the model's output width for GGUF vocabularies).
    pub fn vocab_size(&self) -> usize {
        self.kinds.len()
    }

    /// Control, unknown or user-defined: tokens cut out before BPE that render as their text.
    pub fn is_special(&self, id: u32) -> bool {
        self.kinds.get(id as usize).is_some_and(|k| k.is_special())
    }

    /// The raw bytes a token stands for (special tokens give their text). Ids outside the
    /// vocabulary give nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.pieces.get(id).to_vec()
    }

    /// Ids → text, special tokens included as their text. Invalid UTF-8 (a sequence cut short)
    /// becomes U+FFFD. No spaces are cleaned up, so this equals concatenating streamed pieces.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.pieces.get(id));
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// A streaming detokenizer over this vocabulary (it shares the piece table).
    pub fn detokenizer(&self) -> Detokenizer {
        Detokenizer::new(self)
    }
}
