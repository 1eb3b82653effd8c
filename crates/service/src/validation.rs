//! What counts as text in anything people write (messages, titles, system prompts, imports):
//! the one check every interface and service calls.

/// Names the first character of `text` that no person types into a chat message: NUL, which
/// C-based tools (and SQLite's text functions) treat as the end of the string, and the
/// noncharacters (U+FDD0–U+FDEF, U+xFFFE/U+xFFFF), which Unicode reserves for internal use.
pub fn not_text(text: &str) -> Option<String> {
    text.chars()
        .find(|&c| {
            c == '\0' || ('\u{FDD0}'..='\u{FDEF}').contains(&c) || (c as u32) & 0xFFFE == 0xFFFE
        })
        .map(|c| {
            if c == '\0' {
                "a NUL character (U+0000)".to_string()
            } else {
                format!("the noncharacter U+{:04X}", c as u32)
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_and_noncharacters_are_named_and_text_passes() {
        assert_eq!(not_text("plain, ünïcode, 🙂, \u{200B}"), None);
        assert_eq!(
            not_text("a\0b").as_deref(),
            Some("a NUL character (U+0000)")
        );
        assert_eq!(
            not_text("x\u{FDD0}").as_deref(),
            Some("the noncharacter U+FDD0")
        );
        assert_eq!(
            not_text("\u{10FFFF}").as_deref(),
            Some("the noncharacter U+10FFFF")
        );
        assert_eq!(
            not_text("\u{FFFD}"),
            None,
            "the replacement character is text"
        );
    }
}
