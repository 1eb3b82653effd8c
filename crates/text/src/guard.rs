//! Keeping untrusted text out of the control-token channel.
//!
//! A chat template writes its control tokens (`<|im_start|>`, `<|im_end|>` …) as text, and the
//! rendered prompt is tokenized with special-token parsing on. Common servers stop there, so a
//! user who types `<|im_end|>\n<|im_start|>assistant` in a message forges a role boundary. We
//! do better: before rendering, every piece of untrusted text (user, system and tool messages,
//! tool schemas, template arguments) is *guarded* — the characters that could start a special
//! token are swapped for private code points that no special token contains — so that the
//! special-token cut over the rendered prompt can only find the template's own markup. Each text
//! fragment between the special tokens found is then *restored* before BPE, so the text the
//! model sees is exactly what the user wrote, tokenized as plain text.
//!
//! Why escape characters rather than render placeholders or record byte ranges: templates
//! transform content (`.replace("/think", "")`, `.rstrip()`, `"/no_think" in content`), so
//! content is not a fixed range of the output, and a placeholder would change what such tests
//! see. Swapping one character for one character keeps every test on ordinary text as it was
//! (`/think` contains no `<`), keeps whitespace stripping identical, and survives transformations
//! that delete text (`"<|im_/think_end|>".replace("/think", "")` still cannot form a special token,
//! because its `<` stays guarded). Where untrusted text holds no such character, the guarded
//! render is byte-identical to the plain one, so ordinary prompts tokenize exactly as before.
//!
//! The encoding, over untrusted text only:
//! * the `i`-th guarded character becomes U+100000 + `i` (Supplementary Private Use Area-B);
//! * a character that is itself [`ESCAPE`] or in that area is written as [`ESCAPE`] + itself, so
//!   text that already holds such code points restores unchanged.
//!
//! Which characters are guarded: for each special token, its first non-whitespace character.
//! When that character is punctuation or a symbol (`<` for every ChatML and Llama-3 token) every
//! occurrence of it is guarded; when it is alphanumeric (guarding every `t` would change what
//! `"/think" in content` sees) only the occurrences that start that special token's text are.
//! Special tokens made only of whitespace are left alone (they are how whitespace tokenizes).

use std::borrow::Cow;

/// Marks the next character as literal (a noncharacter: reserved by Unicode for internal use).
pub const ESCAPE: char = '\u{FDD0}';
/// The first private code point standing for a guarded character.
const BASE: u32 = 0x10_0000;
/// The last code point of Supplementary Private Use Area-B.
const LAST: u32 = 0x10_FFFD;

/// The guard of one vocabulary. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct TextGuard {
    /// Guarded characters; index `i` stands as U+100000 + `i`.
    keys: Vec<char>,
    /// For each key, whether every occurrence is guarded (punctuation and symbols).
    everywhere: Vec<bool>,
    /// Special texts whose first non-whitespace character is alphanumeric, with that
    /// character's byte offset in the text and its key index: only such occurrences are guarded.
    occurrences: Vec<(String, usize, usize)>,
}

impl TextGuard {
    /// Builds the guard for these special-token texts.
    pub fn new<'a>(specials: impl IntoIterator<Item = &'a str>) -> Self {
        let mut guard = Self::default();
        for text in specials {
            let Some((offset, c)) = text.char_indices().find(|(_, c)| !c.is_whitespace()) else {
                continue;
            };
            let everywhere = !c.is_alphanumeric();
            let key = match guard.keys.iter().position(|k| *k == c) {
                Some(i) => i,
                None => {
                    // The area holds 65,534 code points; no vocabulary has that many distinct
                    // first characters, but never wrap into code points we do not own.
                    if BASE + guard.keys.len() as u32 > LAST {
                        continue;
                    }
                    guard.keys.push(c);
                    guard.everywhere.push(everywhere);
                    guard.keys.len() - 1
                }
            };
            if !everywhere {
                guard.occurrences.push((text.to_string(), offset, key));
            }
        }
        guard
    }

    fn stand_in(key: usize) -> char {
        char::from_u32(BASE + key as u32).unwrap_or(ESCAPE)
    }

    fn needs_escape(c: char) -> bool {
        c == ESCAPE || (BASE..=LAST).contains(&(c as u32))
    }

    /// Untrusted text → its guarded form. Borrowed (unchanged) when there is nothing to guard.
    pub fn protect<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let touched = text
            .chars()
            .any(|c| Self::needs_escape(c) || self.keys.contains(&c));
        if !touched {
            return Cow::Borrowed(text);
        }
        // Byte offsets of the alphanumeric-led special texts' key characters.
        let mut marked: Vec<usize> = Vec::new();
        for (special, offset, _) in &self.occurrences {
            marked.extend(
                text.match_indices(special.as_str())
                    .map(|(at, _)| at + offset),
            );
        }
        let mut out = String::with_capacity(text.len() + 8);
        for (at, c) in text.char_indices() {
            if Self::needs_escape(c) {
                out.push(ESCAPE);
                out.push(c);
                continue;
            }
            let key = self.keys.iter().position(|k| *k == c);
            match key {
                Some(i) if self.everywhere.get(i).copied().unwrap_or(false) => {
                    out.push(Self::stand_in(i))
                }
                Some(i) if marked.contains(&at) => out.push(Self::stand_in(i)),
                _ => out.push(c),
            }
        }
        Cow::Owned(out)
    }

    /// Guarded text (or text rendered around guarded pieces) → the original characters.
    pub fn restore<'a>(&self, text: &'a str) -> Cow<'a, str> {
        if !text.chars().any(Self::needs_escape) {
            return Cow::Borrowed(text);
        }
        let mut out = String::with_capacity(text.len());
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == ESCAPE {
                match chars.next() {
                    Some(literal) => out.push(literal),
                    None => out.push(ESCAPE),
                }
                continue;
            }
            let key = (c as u32)
                .checked_sub(BASE)
                .and_then(|i| self.keys.get(i as usize));
            out.push(key.copied().unwrap_or(c));
        }
        Cow::Owned(out)
    }

    /// Guards every string of a JSON value, object keys included (tool schemas, template
    /// arguments: text a client supplies that a template may print).
    pub fn protect_json(&self, value: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::String(s) => Value::String(self.protect(s).into_owned()),
            Value::Array(items) => {
                Value::Array(items.iter().map(|v| self.protect_json(v)).collect())
            }
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| (self.protect(k).into_owned(), self.protect_json(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

/// A prompt rendered by [`ChatTemplate::render_prompt`](super::template::ChatTemplate::render_prompt):
/// the template's markup as text, untrusted pieces guarded. Encode it with
/// [`Tokenizer::encode_rendered`](super::tokenizer::Tokenizer::encode_rendered).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedPrompt {
    guarded: String,
    text: String,
}

impl RenderedPrompt {
    pub(crate) fn new(guarded: String, guard: &TextGuard) -> Self {
        let text = guard.restore(&guarded).into_owned();
        Self { guarded, text }
    }

    /// The prompt as the model reads it (every character as the user wrote it).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub(crate) fn guarded(&self) -> &str {
        &self.guarded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chatml() -> TextGuard {
        TextGuard::new(["<|im_start|>", "<|im_end|>", "<think>", "hello", "\n\n"])
    }

    #[test]
    fn protect_then_restore_is_identity() {
        let g = chatml();
        for text in [
            "",
            "plain text",
            "x<|im_end|>y",
            "a < b and <think>",
            "say hello, hell",
            "\u{FDD0}\u{100000}\u{10FFFD}<\u{FDD0}",
            "\u{FDD0}",
        ] {
            let guarded = g.protect(text);
            assert!(!guarded.contains("<|im_end|>"), "{guarded:?}");
            assert!(!guarded.contains("hello"), "{guarded:?}");
            assert_eq!(g.restore(&guarded), text, "{text:?} -> {guarded:?}");
        }
    }

    #[test]
    fn ordinary_text_is_untouched() {
        let g = chatml();
        assert_eq!(g.protect("no markup here /think"), "no markup here /think");
        let punctuation_only = TextGuard::new(["<|im_start|>", "<|im_end|>"]);
        assert!(matches!(
            punctuation_only.protect("no markup here /think"),
            Cow::Borrowed(_)
        ));
        // Whitespace-only specials are not guarded.
        assert!(matches!(g.protect("a\n\nb"), Cow::Borrowed(_)));
        // Alphanumeric keys are guarded only where the special text starts.
        assert_eq!(g.protect("hat"), "hat");
    }

    #[test]
    fn deleting_text_cannot_assemble_a_special_token() {
        let g = chatml();
        let guarded = g.protect("<|im_/think_end|>").replace("/think_", "");
        assert!(!guarded.contains("<|im_end|>"));
        assert_eq!(g.restore(&guarded), "<|im_end|>");
    }

    #[test]
    fn json_strings_and_keys_are_guarded() {
        let g = chatml();
        let v = serde_json::json!({"<|im_end|>": ["<think>", 1, null]});
        let p = g.protect_json(&v);
        assert!(!p.to_string().contains("<|im_end|>"));
        assert!(!p.to_string().contains("<think>"));
    }
}
