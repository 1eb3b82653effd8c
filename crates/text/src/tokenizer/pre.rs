//! The pre-tokenizer each `tokenizer.ggml.pre` name stands for. GGUF files name the split rules
//! without storing them, so the patterns here are llama.cpp's.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use super::vocab::KEY_PRE;
use crate::error::{Result, TextError};

/// Llama 3's pattern with llama.cpp's case-insensitive contractions spelled out (`(?i:…)` would
/// also fold non-ASCII look-alikes such as U+017F into `s`).
pub const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values we accept (and say so in the error for any other).
const SUPPORTED_PRE: &str =
    "smollm, smaug-bpe, llama-bpe, llama3, llama-v3, gpt-2, gpt2, default (or no key)";

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
pub(super) struct PreSpec {
    split: PreSplit,
    /// A whole pre-token that is itself in the vocabulary is taken as is (llama.cpp sets this for
    /// the `llama3` names only, not for `smaug-bpe`, and BPE can give a different split there).
    pub(super) ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when the file has no `tokenizer.ggml.add_bos_token`.
    pub(super) add_bos_default: bool,
}

impl PreSpec {
    pub(super) fn from_name(name: Option<&str>) -> Result<Self> {
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

    pub(super) fn build(self) -> Result<PreTokenizerWrapper> {
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
