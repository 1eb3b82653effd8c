//! Building a [`Tokenizer`] from the GGUF metadata or from a `tokenizer.json` override. Both end in
//! one `assemble`, so special tokens, BOS and end-of-generation ids are found the same way.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{DecoderWrapper, Model, ModelWrapper, NormalizerWrapper, PreTokenizerWrapper};

use super::decode::Pieces;
use super::pre::PreSpec;
use super::vocab::{
    TokenKind, CONTROL_LOOKING, EOG_TEXTS, KEY_ADD_BOS, KEY_BOS, KEY_EOM, KEY_EOS, KEY_EOT,
    KEY_MERGES, KEY_MODEL, KEY_PRE, KEY_TOKENS, KEY_TOKEN_TYPE,
};
use super::{tok_err, Special, Tokenizer};
use crate::error::{Result, TextError};
use crate::guard::TextGuard;
use smolchat_gguf::{value_as_u64, GgufSource, Value};

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
}
