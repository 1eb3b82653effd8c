//! What a GGUF vocabulary's metadata means as llama.cpp reads it: the keys, the token types, and
//! the texts it treats as control or end-of-generation tokens whatever their declared type.

pub(super) const KEY_MODEL: &str = "tokenizer.ggml.model";
pub(super) const KEY_PRE: &str = "tokenizer.ggml.pre";
pub(super) const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub(super) const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub(super) const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub(super) const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
pub(super) const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
pub(super) const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
pub(super) const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
pub(super) const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

/// Texts llama.cpp treats as control tokens whatever their declared type, because they end a
/// turn or fill a FIM slot (its EOT/EOM/FIM/EOG lists). Marking them control keeps them out of
/// plain-text tokenization exactly as llama.cpp does.
pub(super) const CONTROL_LOOKING: &[&str] = &[
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
pub(super) const EOG_TEXTS: &[&str] = &[
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
pub(super) enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    Undefined,
}

impl TokenKind {
    pub(super) fn from_gguf(t: i64) -> Self {
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
    pub(super) fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown | Self::UserDefined)
    }
}
