//! The vocabulary a synthetic model carries: a real model's `tokenizer.*` keys, so it can be
//! driven with real text, or a placeholder one for engines that refuse a file without any.

use super::SyntheticSpec;
use crate::error::{EngineError, Result};
use smolchat_gguf::{GgufSource, Value};

/// `tokenizer.*` metadata copied from a real model. Its `Debug` output is a summary: the token
/// and merge arrays run to tens of thousands of entries.
#[derive(Clone, Default)]
pub struct TokenizerMetadata(pub Vec<(String, Value)>);

impl std::fmt::Debug for TokenizerMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.0.iter().map(|(k, _)| k.as_str()).collect();
        write!(f, "TokenizerMetadata({keys:?})")
    }
}

impl SyntheticSpec {
    /// Copies every `tokenizer.*` key of `src` (a real model's vocabulary, merges, special
    /// tokens and chat template) and sets `vocab_size` to its token count, so the model can be
    /// driven with real text. SmolLM2's tokenizer gives a vocabulary of 49152.
    pub fn with_tokenizer_from(mut self, src: &GgufSource) -> Result<Self> {
        let tokens_key = "tokenizer.ggml.tokens";
        let n_tokens = match src.require(tokens_key)? {
            Value::Array(tokens) if !tokens.is_empty() => tokens.len(),
            _ => {
                return Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                    key: tokens_key.to_string(),
                    detail: "expected a non-empty array of token strings".to_string(),
                }))
            }
        };
        let mut keys: Vec<(String, Value)> = src
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // HashMap order is random; sorted keys keep written files byte-identical.
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        self.tokenizer = TokenizerMetadata(keys);
        self.vocab_size = n_tokens;
        Ok(self)
    }

    /// [`Self::with_tokenizer_from`], keeping this shape's vocabulary size: the real model's
    /// tokens come first, the rest are `<|synthetic_N|>` tokens marked unused (no text maps to
    /// them). A shape larger than the real vocabulary (the SmolLM3-3B shape's 128,256 beside
    /// SmolLM2's 49,152) is then driven with real text, in prompts of realistic lengths, and
    /// other engines load it as they load the real model.
    pub fn with_tokenizer_padded_from(self, src: &GgufSource) -> Result<Self> {
        let shape_vocab = self.vocab_size;
        let mut spec = self.with_tokenizer_from(src)?;
        let real = spec.vocab_size;
        if real > shape_vocab {
            return Err(EngineError::from(smolchat_gguf::GgufError::BadKey {
                key: "tokenizer.ggml.tokens".to_string(),
                detail: format!(
                    "the tokenizer has {real} tokens, more than the shape's vocabulary of \
                     {shape_vocab}"
                ),
            }));
        }
        let padding = real..shape_vocab;
        for (key, value) in &mut spec.tokenizer.0 {
            let Value::Array(items) = value else { continue };
            // Each array keeps its own element type (GGUF arrays are of one type).
            let filler = |i: usize| match (key.as_str(), items.first()) {
                ("tokenizer.ggml.tokens", _) => Some(Value::String(format!("<|synthetic_{i}|>"))),
                ("tokenizer.ggml.token_type", Some(Value::U32(_))) => Some(Value::U32(5)),
                ("tokenizer.ggml.token_type", _) => Some(Value::I32(5)),
                ("tokenizer.ggml.scores", _) => Some(Value::F32(0.0)),
                _ => None,
            };
            let extra: Vec<Value> = padding.clone().filter_map(filler).collect();
            items.extend(extra);
        }
        spec.vocab_size = shape_vocab;
        Ok(spec)
    }

    /// Gives the model a placeholder byte-level BPE vocabulary of `vocab_size` tokens (the 256
    /// byte tokens, then `<|synthetic_N|>` fillers; no merges) so other engines that insist on a
    /// tokenizer, such as llama.cpp, can load the file. Used to measure llama.cpp on the same
    /// synthetic weights; the text it would produce is meaningless.
    pub fn with_placeholder_tokenizer(mut self) -> Self {
        let bytes = byte_level_alphabet();
        let mut tokens: Vec<Value> = bytes.iter().map(|c| Value::String(c.to_string())).collect();
        for i in tokens.len()..self.vocab_size {
            tokens.push(Value::String(format!("<|synthetic_{i}|>")));
        }
        tokens.truncate(self.vocab_size);
        let types: Vec<Value> = (0..tokens.len())
            .map(|i| Value::I32(if i < 256 { 1 } else { 3 }))
            .collect();
        let last = self.vocab_size.saturating_sub(1) as u32;
        self.tokenizer = TokenizerMetadata(vec![
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            (
                "tokenizer.ggml.pre".into(),
                Value::String("smaug-bpe".into()),
            ),
            ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
            ("tokenizer.ggml.token_type".into(), Value::Array(types)),
            ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(last)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(last)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ]);
        self
    }
}

/// GPT-2's byte-to-character table: the 256 characters byte-level BPE uses for raw bytes.
fn byte_level_alphabet() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<(u32, char)> = printable
        .iter()
        .filter_map(|&b| char::from_u32(b).map(|c| (b, c)))
        .collect();
    let mut extra = 0u32;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            if let Some(c) = char::from_u32(256 + extra) {
                chars.push((b, c));
            }
            extra += 1;
            printable.push(b);
        }
    }
    chars.sort_by_key(|(b, _)| *b);
    chars.into_iter().map(|(_, c)| c).collect()
}
