//! The one place conversation settings are checked. The settings page and the JSON API both
//! call [`check`], so the same input gets the same refusal with the same message whichever way it
//! came; the OpenAI API's per-request sampling fields go through the same
//! [`SamplingParams::validate`](crate::engine::sampling::SamplingParams::validate) underneath.

use crate::engine::sampling::SamplingParams;
use crate::store::ConversationSettings;

use super::session::not_text;

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
    /// A value generation cannot use; the message names the field.
    #[error("{0}")]
    Invalid(String),
}

/// Refuses settings a reply could not be generated with.
pub fn check(s: &ConversationSettings, limits: SettingsLimits) -> Result<(), SettingsError> {
    let invalid = |m: String| Err(SettingsError::Invalid(m));
    if let Some(prompt) = &s.system_prompt {
        let chars = prompt.chars().count();
        if chars > limits.max_prompt_chars {
            return Err(SettingsError::PromptTooLong {
                chars,
                limit: limits.max_prompt_chars,
            });
        }
        if let Some(what) = not_text(prompt) {
            return invalid(format!(
                "`system_prompt` contains {what}, which is not text; remove it"
            ));
        }
    }
    if s.max_tokens == 0 || s.max_tokens > limits.max_new_tokens {
        return invalid(format!(
            "`max_tokens` must be between 1 and {}, got {}",
            limits.max_new_tokens, s.max_tokens
        ));
    }
    SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        max_new_tokens: s.max_tokens,
        seed: s.seed,
        ..SamplingParams::default()
    }
    .validate()
    .map_err(|e| SettingsError::Invalid(e.to_string()))?;
    s.validate().map_err(SettingsError::Invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: SettingsLimits = SettingsLimits {
        max_prompt_chars: 10,
        max_new_tokens: 100,
    };

    #[test]
    fn each_bad_value_is_refused_naming_its_field() {
        let ok = ConversationSettings {
            max_tokens: 10,
            ..ConversationSettings::default()
        };
        assert_eq!(check(&ok, LIMITS), Ok(()));
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
        ];
        for (s, field) in cases {
            let err = check(&s, LIMITS).expect_err(field).to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
