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
//! patterns below are llama.cpp's (`src/llama-vocab.cpp`) for the names we support.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    DecoderWrapper, Model, ModelWrapper, NormalizedString, Normalizer, NormalizerWrapper,
    OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, PreTokenizerWrapper,
    SplitDelimiterBehavior,
};

use super::guard::{RenderedPrompt, TextGuard};
use crate::error::{Result, TextError};
use smolchat_gguf::{value_as_u64, GgufSource, Value};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

/// Llama 3's pattern with llama.cpp's case-insensitive contractions spelled out (`(?i:…)` would
/// also fold non-ASCII look-alikes such as U+017F into `s`).
pub const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values we accept (and say so in the error for any other).
const SUPPORTED_PRE: &str =
    "smollm, smaug-bpe, llama-bpe, llama3, llama-v3, gpt-2, gpt2, default (or no key)";

/// Texts llama.cpp treats as control tokens whatever their declared type, because they end a
/// turn or fill a FIM slot (its EOT/EOM/FIM/EOG lists). Marking them control keeps them out of
/// plain-text tokenization exactly as llama.cpp does.
const CONTROL_LOOKING: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// Texts that end generation in llama.cpp's EOG heuristic (a subset of [`CONTROL_LOOKING`]).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// A token's role, from `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    Undefined,
}

impl TokenKind {
    fn from_gguf(t: i64) -> Self {
        match t {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }

    /// Tokens that are cut out of the text before BPE and render as their own text.
    fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown | Self::UserDefined)
    }
}

/// How a pre-tokenizer name is handled: which split, and llama.cpp's per-name flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PreSplit {
    /// GPT-2's regex, inside the `ByteLevel` pre-tokenizer.
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (SmolLM2 and the StarCoder family).
    DigitsThenGpt2,
    /// The Llama 3 regex (SmolLM3 ships it as `smaug-bpe`).
    Llama3,
}

#[derive(Clone, Copy, Debug)]
struct PreSpec {
    split: PreSplit,
    /// A whole pre-token that is itself in the vocabulary is taken as is (llama.cpp sets this for
    /// the `llama3` names only, not for `smaug-bpe`, and BPE can give a different split there).
    ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos_default: bool,
}

impl PreSpec {
    fn from_name(name: Option<&str>) -> Result<Self> {
        let spec = |split, ignore_merges, add_bos_default| PreSpec {
            split,
            ignore_merges,
            add_bos_default,
        };
        Ok(match name {
            Some("smollm") => spec(PreSplit::DigitsThenGpt2, false, false),
            Some("smaug-bpe") => spec(PreSplit::Llama3, false, false),
            Some("llama-bpe" | "llama3" | "llama-v3") => spec(PreSplit::Llama3, true, true),
            Some("gpt-2" | "gpt2") => spec(PreSplit::Gpt2, false, false),
            Some("default") | None => {
                // llama.cpp's "default" chains four regexes and warns that quality degrades; the
                // model's own Hugging Face tokenizer in that case is plain GPT-2 byte-level,
                // which is what the weights were trained on, so that is what we use.
                tracing::warn!(
                    pre = name.unwrap_or("<missing>"),
                    "the GGUF file does not name a specific pre-tokenizer; using GPT-2 byte-level \
                     splitting (llama.cpp uses its own 'default' regexes here)"
                );
                spec(PreSplit::Gpt2, false, false)
            }
            Some(other) => {
                return Err(TextError::Tokenizer(format!(
                    "the GGUF file's pre-tokenizer `{KEY_PRE}` is `{other}`, which smolchat does \
                     not know (supported: {SUPPORTED_PRE}); use a SmolLM2/SmolLM3 GGUF or supply \
                     the model's tokenizer.json"
                )))
            }
        })
    }

    fn build(self) -> Result<PreTokenizerWrapper> {
        // add_prefix_space is off for every GGUF BPE vocabulary (llama.cpp never adds one).
        let byte_level = |use_regex| ByteLevel::new(false, false, use_regex);
        Ok(match self.split {
            PreSplit::Gpt2 => PreTokenizerWrapper::ByteLevel(byte_level(true)),
            PreSplit::DigitsThenGpt2 => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level(true)),
            ])),
            PreSplit::Llama3 => {
                let split = Split::new(
                    SplitPattern::Regex(LLAMA3_PATTERN.to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| {
                    TextError::Tokenizer(format!("cannot compile the Llama 3 pattern: {e}"))
                })?;
                PreTokenizerWrapper::Sequence(Sequence::new(vec![
                    PreTokenizerWrapper::Split(split),
                    PreTokenizerWrapper::ByteLevel(byte_level(false)),
                ]))
            }
        })
    }
}

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
struct Pieces {
    bytes: Vec<u8>,
    offsets: Vec<usize>,
}

impl Pieces {
    fn build<'a>(tokens: impl ExactSizeIterator<Item = (TokenKind, &'a str)>) -> Self {
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

    fn get(&self, id: u32) -> &[u8] {
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

fn bad_key(key: &str, detail: impl Into<String>) -> TextError {
    smolchat_gguf::GgufError::bad_key(key, detail).into()
}

fn string_array<'a>(src: &'a GgufSource, key: &str) -> Result<Vec<&'a str>> {
    match src.require(key)? {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(bad_key(
                    key,
                    format!("item {i} should be a string but is {other:?}"),
                )),
            })
            .collect(),
        other => Err(bad_key(
            key,
            format!("expected an array of strings, found {other:?}"),
        )),
    }
}

fn int_array(src: &GgufSource, key: &str) -> Result<Option<Vec<i64>>> {
    let Some(v) = src.get(key) else {
        return Ok(None);
    };
    let Value::Array(items) = v else {
        return Err(bad_key(key, "expected an array of integers"));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::I8(x) => Ok(i64::from(*x)),
            Value::I16(x) => Ok(i64::from(*x)),
            Value::I32(x) => Ok(i64::from(*x)),
            Value::I64(x) => Ok(*x),
            other => value_as_u64(other)
                .and_then(|x| i64::try_from(x).ok())
                .ok_or_else(|| bad_key(key, format!("item {i} is not an integer"))),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// A token id from the metadata, dropped with a warning when it is outside the vocabulary
/// (llama.cpp does the same rather than refusing the file).
fn opt_token_id(src: &GgufSource, key: &str, n_vocab: usize) -> Result<Option<u32>> {
    let Some(id) = src.opt_usize(key)? else {
        return Ok(None);
    };
    match u32::try_from(id) {
        Ok(id) if (id as usize) < n_vocab => Ok(Some(id)),
        _ => {
            tracing::warn!(
                key,
                id,
                n_vocab,
                "special token id is outside the vocabulary; ignoring it"
            );
            Ok(None)
        }
    }
}

/// The special-token ids and flags that come from the GGUF whichever vocabulary is used.
struct GgufSpecials {
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    add_bos: Option<bool>,
}

impl GgufSpecials {
    fn read(src: &GgufSource, n_vocab: usize) -> Result<Self> {
        Ok(Self {
            bos: opt_token_id(src, KEY_BOS, n_vocab)?,
            eos: opt_token_id(src, KEY_EOS, n_vocab)?,
            eot: opt_token_id(src, KEY_EOT, n_vocab)?,
            eom: opt_token_id(src, KEY_EOM, n_vocab)?,
            add_bos: src.opt_bool(KEY_ADD_BOS),
        })
    }
}

/// Everything [`Tokenizer::assemble`] needs, from whichever source.
struct Parts<'a> {
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: Option<PreTokenizerWrapper>,
    model: ModelWrapper,
    /// Per id: kind and text (byte-level for normal tokens, raw for special ones).
    tokens: Vec<(TokenKind, &'a str)>,
    /// Per id, tokenizer.json's lstrip/rstrip (empty for GGUF vocabularies).
    strip: HashMap<u32, (bool, bool)>,
    gguf: GgufSpecials,
    add_bos_default: bool,
    origin: String,
}

impl Tokenizer {
    /// The tokenizer a model is served with: the `tokenizer.json` override when one is given,
    /// else the GGUF's own vocabulary.
    pub fn load(src: &GgufSource, tokenizer_json: Option<&Path>) -> Result<Self> {
        match tokenizer_json {
            Some(json) => Self::from_json_file(json, src),
            None => Self::from_gguf(src),
        }
    }

    /// Builds the tokenizer from the GGUF metadata alone (`tokenizer.ggml.*`).
    pub fn from_gguf(src: &GgufSource) -> Result<Self> {
        let started = Instant::now();
        let model_name = src.string(KEY_MODEL)?;
        if model_name != "gpt2" {
            return Err(TextError::Tokenizer(format!(
                "the GGUF vocabulary `{KEY_MODEL}` is `{model_name}`, but smolchat only runs \
                 `gpt2` (byte-level BPE) vocabularies, as SmolLM2 and SmolLM3 use"
            )));
        }
        let pre_name = match src.get(KEY_PRE) {
            None => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(other) => {
                return Err(bad_key(
                    KEY_PRE,
                    format!("expected a string, found {other:?}"),
                ))
            }
        };
        let pre = PreSpec::from_name(pre_name)?;

        let raw_tokens = string_array(src, KEY_TOKENS)?;
        let n = raw_tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(bad_key(KEY_TOKENS, format!("has {n} tokens")));
        }
        // llama.cpp renames empty tokens so that every text maps to one id; so do we.
        let empty_names: HashMap<usize, String> = raw_tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_empty())
            .map(|(i, _)| (i, format!("[EMPTY_{i}]")))
            .collect();
        if !empty_names.is_empty() {
            tracing::warn!(count = empty_names.len(), "the vocabulary has empty tokens");
        }
        let texts: Vec<&str> = raw_tokens
            .iter()
            .enumerate()
            .map(|(i, t)| empty_names.get(&i).map_or(*t, String::as_str))
            .collect();

        let mut kinds = match int_array(src, KEY_TOKEN_TYPE)? {
            None => vec![TokenKind::Normal; n],
            Some(types) if types.len() < n => {
                return Err(bad_key(
                    KEY_TOKEN_TYPE,
                    format!("has {} entries for {n} tokens", types.len()),
                ))
            }
            Some(types) => types
                .iter()
                .take(n)
                .map(|&t| TokenKind::from_gguf(t))
                .collect(),
        };
        for (kind, text) in kinds.iter_mut().zip(&texts) {
            // A user-defined one is promoted too: llama.cpp then skips it without special
            // parsing, like any control token.
            if CONTROL_LOOKING.contains(text)
                && !matches!(*kind, TokenKind::Control | TokenKind::Unknown)
            {
                tracing::warn!(
                    token = *text,
                    "control-looking token is not typed as control; treating it as control, \
                     as llama.cpp does"
                );
                *kind = TokenKind::Control;
            }
        }

        let mut vocab = Vocab::with_capacity(n);
        let mut duplicates = 0usize;
        for (id, text) in texts.iter().enumerate() {
            if vocab.contains_key(*text) {
                duplicates += 1;
            } else {
                vocab.insert((*text).to_string(), id as u32);
            }
        }
        if duplicates > 0 {
            tracing::warn!(
                duplicates,
                "the vocabulary repeats some token texts; the first id of each is used"
            );
        }

        let merges = Self::gguf_merges(src, &vocab)?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(tok_err(
                "cannot build the BPE model from the GGUF vocabulary",
            ))?;

        let tokens = kinds.iter().copied().zip(texts.iter().copied()).collect();
        let tokenizer = Self::assemble(Parts {
            normalizer: None,
            pre_tokenizer: Some(pre.build()?),
            model: ModelWrapper::BPE(bpe),
            tokens,
            strip: HashMap::new(),
            gguf: GgufSpecials::read(src, n)?,
            add_bos_default: pre.add_bos_default,
            origin: format!("GGUF (pre-tokenizer `{}`)", pre_name.unwrap_or("default")),
        })?;
        tracing::info!(
            vocab = n,
            pre = pre_name.unwrap_or("default"),
            specials = tokenizer.specials.len(),
            ms = started.elapsed().as_millis() as u64,
            "tokenizer built from GGUF metadata"
        );
        Ok(tokenizer)
    }

    /// The merges as (left, right) pairs, in rank order. A merge whose parts or result are not in
    /// the vocabulary can never fire in a sound file; it is dropped (the BPE builder would refuse
    /// the whole vocabulary), as is a repeated pair (llama.cpp keeps the first rank).
    fn gguf_merges(src: &GgufSource, vocab: &Vocab) -> Result<Vec<(String, String)>> {
        let raw = string_array(src, KEY_MERGES)?;
        let mut merges = Vec::with_capacity(raw.len());
        let mut seen = std::collections::HashSet::with_capacity(raw.len());
        let mut dropped = 0usize;
        let mut joined = String::new();
        for m in raw {
            // llama.cpp splits at the first space after the first byte, so a left part may
            // itself start with a space.
            let split = m
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1);
            let Some((a, b)) = split.and_then(|p| Some((m.get(..p)?, m.get(p + 1..)?))) else {
                dropped += 1;
                continue;
            };
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&joined) {
                dropped += 1;
                continue;
            }
            if !seen.insert((a, b)) {
                dropped += 1;
                continue;
            }
            merges.push((a.to_string(), b.to_string()));
        }
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "some BPE merges are malformed, repeated or name tokens missing from the \
                 vocabulary; they are ignored"
            );
        }
        Ok(merges)
    }

    /// Builds the tokenizer from a Hugging Face `tokenizer.json` (an override for files whose
    /// GGUF vocabulary is unusable). BOS/EOS ids and `add_bos` still come from the GGUF, so the
    /// model and the tokenizer agree on them. Only byte-level BPE tokenizers are accepted.
    pub fn from_json_file(path: &Path, gguf: &GgufSource) -> Result<Self> {
        let context = format!("cannot load {}", path.display());
        let hf = tokenizers::Tokenizer::from_file(path).map_err(tok_err(&context))?;
        if !matches!(hf.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return Err(TextError::Tokenizer(format!(
                "{} is not a byte-level BPE tokenizer (its decoder is not `ByteLevel`); smolchat \
                 only runs byte-level BPE vocabularies such as SmolLM2's and SmolLM3's",
                path.display()
            )));
        }
        let model = hf.get_model().clone();
        let added = hf.get_added_tokens_decoder();
        let n = hf
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .map_or(0, |m| m as usize + 1);
        if n == 0 {
            return Err(TextError::Tokenizer(format!(
                "{} has an empty vocabulary",
                path.display()
            )));
        }
        // The model can only embed ids below its own vocabulary size.
        let model_vocab = match gguf.get(KEY_TOKENS) {
            Some(Value::Array(items)) => Some(items.len()),
            _ => None,
        };
        if let Some(m) = model_vocab {
            if n > m {
                return Err(TextError::Tokenizer(format!(
                    "{} has ids up to {} but the model's vocabulary has only {m} tokens",
                    path.display(),
                    n - 1
                )));
            }
            if n != m {
                tracing::warn!(
                    json = n,
                    gguf = m,
                    "tokenizer.json and the GGUF vocabulary differ in size"
                );
            }
        }

        let mut owned: Vec<(TokenKind, String)> = Vec::with_capacity(n);
        let mut strip = HashMap::new();
        for id in 0..n as u32 {
            if let Some(at) = added.get(&id) {
                let kind = if at.special {
                    TokenKind::Control
                } else {
                    TokenKind::UserDefined
                };
                if at.lstrip || at.rstrip {
                    strip.insert(id, (at.lstrip, at.rstrip));
                }
                owned.push((kind, at.content.clone()));
            } else if let Some(text) = model.id_to_token(id) {
                owned.push((TokenKind::Normal, text));
            } else {
                owned.push((TokenKind::Undefined, String::new()));
            }
        }
        let pre_name = gguf.opt_string(KEY_PRE);
        let add_bos_default = match pre_name {
            Some(name) => PreSpec::from_name(Some(name)).is_ok_and(|p| p.add_bos_default),
            None => false,
        };
        let tokenizer = Self::assemble(Parts {
            normalizer: hf.get_normalizer().cloned(),
            pre_tokenizer: hf.get_pre_tokenizer().cloned(),
            model,
            tokens: owned.iter().map(|(k, t)| (*k, t.as_str())).collect(),
            strip,
            gguf: GgufSpecials::read(gguf, n)?,
            add_bos_default,
            origin: format!("tokenizer.json {}", path.display()),
        })?;
        tracing::info!(
            vocab = n,
            path = %path.display(),
            "tokenizer built from tokenizer.json"
        );
        Ok(tokenizer)
    }

    fn assemble(parts: Parts<'_>) -> Result<Self> {
        let Parts {
            normalizer,
            pre_tokenizer,
            model,
            tokens,
            strip,
            gguf,
            add_bos_default,
            origin,
        } = parts;
        let pieces = Pieces::build(tokens.iter().copied());
        let kinds: Vec<TokenKind> = tokens.iter().map(|(k, _)| *k).collect();

        let mut specials: Vec<Special> = tokens
            .iter()
            .enumerate()
            .filter(|(_, (kind, text))| kind.is_special() && !text.is_empty())
            .map(|(id, (kind, text))| {
                let (lstrip, rstrip) = strip.get(&(id as u32)).copied().unwrap_or_default();
                Special {
                    id: id as u32,
                    text: (*text).to_string(),
                    always: *kind == TokenKind::UserDefined,
                    lstrip,
                    rstrip,
                }
            })
            .collect();
        // Longest first as in llama.cpp; ties by id so the order does not depend on sort details.
        specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        let special_finder = if specials.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::Standard)
                    .build(specials.iter().map(|s| s.text.as_str()))
                    .map_err(|e| {
                        TextError::Tokenizer(format!("cannot index the special tokens: {e}"))
                    })?,
            )
        };
        let special_ids = specials.iter().map(|s| (s.text.clone(), s.id)).collect();
        let guard = TextGuard::new(specials.iter().map(|s| s.text.as_str()));

        let add_bos = gguf.add_bos.unwrap_or(add_bos_default);
        if add_bos && gguf.bos.is_none() {
            return Err(TextError::Tokenizer(format!(
                "`{KEY_ADD_BOS}` is true but the file has no usable `{KEY_BOS}`"
            )));
        }

        // End-of-generation ids, as llama.cpp finds them: the declared EOS/EOT/EOM plus every
        // token whose text is a known end-of-turn marker.
        let mut eog: Vec<u32> = [gguf.eos, gguf.eot, gguf.eom]
            .into_iter()
            .flatten()
            .collect();
        eog.extend(
            tokens
                .iter()
                .enumerate()
                .filter(|(_, (_, text))| EOG_TEXTS.contains(text))
                .map(|(id, _)| id as u32),
        );
        eog.sort_unstable();
        eog.dedup();

        Ok(Self {
            normalizer,
            pre_tokenizer,
            model,
            pieces: Arc::new(pieces),
            kinds,
            specials,
            special_finder,
            special_ids,
            guard,
            bos: gguf.bos,
            eos: gguf.eos,
            add_bos,
            eog,
            origin,
            grammar: std::sync::OnceLock::new(),
        })
    }

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

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`, else llama.cpp's
    /// default for the pre-tokenizer). False for SmolLM2 and SmolLM3.
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
