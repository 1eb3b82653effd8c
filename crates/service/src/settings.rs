//! The one place generation settings are checked. The settings page, the JSON API, imports and
//! the OpenAI API all come here, so the same value gets the same verdict with the same message
//! whichever way it came: conversation settings through [`check`], the OpenAI API's per-request
//! sampling fields through [`check_sampling`] and [`check_ignore_eos`] (which [`check`] calls
//! too).

use smolchat_store::ConversationSettings;
use smolchat_text::constraint::{Grammar, MAX_GRAMMAR_BYTES};
use smolchat_text::sampling::SamplingParams;

use crate::validation::not_text;

/// The highest temperature accepted anywhere (OpenAI's documented range is 0 to 2; beyond it a
/// small model's output is noise).
pub const MAX_TEMPERATURE: f32 = 2.0;

/// The configured bounds the settings are checked against.
#[derive(Debug, Clone, Copy)]
pub struct SettingsLimits {
    /// Longest system prompt, in characters (the message limit).
    pub max_prompt_chars: usize,
    /// Largest `max_tokens`.
    pub max_new_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    #[error("`system_prompt` has {chars} characters; the limit is {limit}")]
    PromptTooLong { chars: usize, limit: usize },
    /// A value generation cannot use; `field` names it, the message says what it must be.
    #[error("{message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    /// A setting only admins may use (`ignore_eos`).
    #[error("{message}")]
    AdminOnly {
        field: &'static str,
        message: String,
    },
}

impl SettingsError {
    /// The field the refusal is about.
    pub fn field(&self) -> &'static str {
        match self {
            SettingsError::PromptTooLong { .. } => "system_prompt",
            SettingsError::Invalid { field, .. } | SettingsError::AdminOnly { field, .. } => field,
        }
    }
}

fn invalid(field: &'static str, message: String) -> Result<(), SettingsError> {
    Err(SettingsError::Invalid { field, message })
}

/// Checks the sampling values of a request or a conversation: the ranges every interface
/// accepts, then the engine's own check ([`SamplingParams::validate`]) for the rest.
pub fn check_sampling(p: &SamplingParams) -> Result<(), SettingsError> {
    if !p.temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&p.temperature) {
        return invalid(
            "temperature",
            format!(
                "`temperature` must be between 0 and {MAX_TEMPERATURE} (0 = greedy), got {}",
                p.temperature
            ),
        );
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return invalid(
            "top_p",
            format!("`top_p` must be in (0, 1] (1 = off), got {}", p.top_p),
        );
    }
    if !(0.0..=1.0).contains(&p.min_p) {
        return invalid(
            "min_p",
            format!("`min_p` must be in [0, 1] (0 = off), got {}", p.min_p),
        );
    }
    if !p.repetition_penalty.is_finite() || p.repetition_penalty <= 0.0 {
        return invalid(
            "repetition_penalty",
            format!(
                "`repetition_penalty` must be a finite number > 0 (1 = off), got {}",
                p.repetition_penalty
            ),
        );
    }
    for (field, v) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return invalid(
                field,
                format!("`{field}` must be between -2 and 2 (0 = off), got {v}"),
            );
        }
    }
    if p.max_new_tokens == 0 {
        return invalid("max_tokens", "`max_tokens` must be at least 1".into());
    }
    p.validate().map_err(|e| SettingsError::Invalid {
        field: "sampling",
        message: e.to_string(),
    })
}

/// `ignore_eos` keeps a reply running past its natural end, up to the token limit: a load
/// generator, not a chat feature, so only admins (and the global API key) may ask for it.
pub fn check_ignore_eos(ignore_eos: bool, admin: bool) -> Result<(), SettingsError> {
    if ignore_eos && !admin {
        return Err(SettingsError::AdminOnly {
            field: "ignore_eos",
            message: "`ignore_eos` is only available to admins (it makes every reply run to its \
                      token limit); leave it out or set it to false"
                .into(),
        });
    }
    Ok(())
}

/// A conversation's GBNF grammar in llguidance's Lark dialect, or why it cannot be used.
fn grammar_of(gbnf: &str) -> Result<Grammar, SettingsError> {
    if gbnf.len() > MAX_GRAMMAR_BYTES {
        return invalid_grammar(format!(
            "`grammar` is {} bytes; at most {MAX_GRAMMAR_BYTES} are accepted",
            gbnf.len()
        ));
    }
    match smolchat_text::gbnf::to_lark(gbnf) {
        Ok(lark) => Ok(Grammar::Lark(lark)),
        Err(e) => invalid_grammar(format!(
            "`grammar` is not a GBNF grammar the server can use: {e} (leave it empty for free text)"
        )),
    }
}

fn invalid_grammar<T>(message: String) -> Result<T, SettingsError> {
    Err(SettingsError::Invalid {
        field: "grammar",
        message,
    })
}

/// The sampling parameters a conversation's replies are generated with. A grammar that does
/// not translate (refused by [`check`] when set, so only a hand-edited store holds one) is
/// left out here and the reply is free text.
pub fn sampling_of(s: &ConversationSettings) -> SamplingParams {
    SamplingParams {
        grammar: s
            .grammar
            .as_deref()
            .filter(|g| !g.trim().is_empty())
            .and_then(|g| grammar_of(g).ok()),
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        max_new_tokens: s.max_tokens,
        seed: s.seed,
        ignore_eos: s.ignore_eos,
        ..SamplingParams::default()
    }
}

/// Refuses settings a reply could not be generated with, or that `admin` may not use.
pub fn check(
    s: &ConversationSettings,
    limits: SettingsLimits,
    admin: bool,
) -> Result<(), SettingsError> {
    if let Some(prompt) = &s.system_prompt {
        let chars = prompt.chars().count();
        if chars > limits.max_prompt_chars {
            return Err(SettingsError::PromptTooLong {
                chars,
                limit: limits.max_prompt_chars,
            });
        }
        if let Some(what) = not_text(prompt) {
            return invalid(
                "system_prompt",
                format!("`system_prompt` contains {what}, which is not text; remove it"),
            );
        }
    }
    if s.max_tokens == 0 || s.max_tokens > limits.max_new_tokens {
        return invalid(
            "max_tokens",
            format!(
                "`max_tokens` must be between 1 and {}, got {}",
                limits.max_new_tokens, s.max_tokens
            ),
        );
    }
    if let Some(g) = s.grammar.as_deref().filter(|g| !g.trim().is_empty()) {
        grammar_of(g)?;
    }
    check_sampling(&sampling_of(s))?;
    check_ignore_eos(s.ignore_eos, admin)?;
    s.validate().map_err(|message| SettingsError::Invalid {
        field: "settings",
        message,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: SettingsLimits = SettingsLimits {
        max_prompt_chars: 10,
        max_new_tokens: 100,
    };

    #[test]
    fn a_conversation_grammar_constrains_its_replies() {
        let s = ConversationSettings {
            grammar: Some("root ::= \"yes\" | \"no\"".into()),
            max_tokens: 10,
            ..ConversationSettings::default()
        };
        assert_eq!(check(&s, LIMITS, false), Ok(()));
        assert!(matches!(sampling_of(&s).grammar, Some(Grammar::Lark(_))));
        // Blank is free text.
        let blank = ConversationSettings {
            grammar: Some("  ".into()),
            ..s.clone()
        };
        assert!(sampling_of(&blank).grammar.is_none());
    }

    #[test]
    fn each_bad_value_is_refused_naming_its_field() {
        let ok = ConversationSettings {
            max_tokens: 10,
            ..ConversationSettings::default()
        };
        assert_eq!(check(&ok, LIMITS, false), Ok(()));
        let cases: Vec<(ConversationSettings, &str)> = vec![
            (
                ConversationSettings {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                ConversationSettings {
                    top_p: 1.5,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                ConversationSettings {
                    temperature: -1.0,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                ConversationSettings {
                    temperature: f32::NAN,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                ConversationSettings {
                    temperature: 2.5,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                ConversationSettings {
                    ignore_eos: true,
                    ..ok.clone()
                },
                "ignore_eos",
            ),
            (
                ConversationSettings {
                    max_tokens: 0,
                    ..ok.clone()
                },
                "max_tokens",
            ),
            (
                ConversationSettings {
                    max_tokens: 101,
                    ..ok.clone()
                },
                "max_tokens",
            ),
            (
                ConversationSettings {
                    system_prompt: Some("a\0b".into()),
                    ..ok.clone()
                },
                "system_prompt",
            ),
            (
                ConversationSettings {
                    system_prompt: Some("x".repeat(11)),
                    ..ok.clone()
                },
                "system_prompt",
            ),
            (
                ConversationSettings {
                    grammar: Some("root ::= \"unclosed".into()),
                    ..ok.clone()
                },
                "grammar",
            ),
            (
                ConversationSettings {
                    grammar: Some(format!("root ::= \"{}\"", "x".repeat(MAX_GRAMMAR_BYTES))),
                    ..ok.clone()
                },
                "grammar",
            ),
        ];
        for (s, field) in cases {
            let err = check(&s, LIMITS, false).expect_err(field);
            assert_eq!(err.field(), field, "{err}");
            let err = err.to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn admins_may_ignore_eos_and_the_api_fields_get_the_same_verdicts() {
        let s = ConversationSettings {
            max_tokens: 10,
            ignore_eos: true,
            ..ConversationSettings::default()
        };
        assert_eq!(check(&s, LIMITS, true), Ok(()));
        // The OpenAI API's fields go through the same check as a conversation's settings.
        let conv = ConversationSettings {
            max_tokens: 10,
            top_p: 0.0,
            ..ConversationSettings::default()
        };
        let api = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert_eq!(check(&conv, LIMITS, false), check_sampling(&api));
        let api = SamplingParams {
            presence_penalty: 3.0,
            ..SamplingParams::default()
        };
        assert_eq!(
            check_sampling(&api).unwrap_err().field(),
            "presence_penalty"
        );
    }
}
