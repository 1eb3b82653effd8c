//! llama.cpp's GBNF grammars (llama-server's `grammar` field) translated into llguidance's Lark
//! dialect, which [`crate::constraint`] compiles.
//!
//! The translation is syntactic: `name ::= body` becomes `name: body`, `root` becomes `start`,
//! rule names become lowercase with `-` as `_` (Lark reserves uppercase names for terminals),
//! character classes `[…]` and `.` become regular expressions, and string literals,
//! alternatives, groups and the `* + ? {m,n}` repetitions keep their form (Lark has them too).
//! Comments (`#` to the end of the line) are dropped. Anything else is an error that says where.

use crate::error::{Result, TextError};

fn err(at: usize, what: impl Into<String>) -> TextError {
    TextError::Constraint(format!("GBNF grammar, byte {at}: {}", what.into()))
}

fn rule_name(name: &str) -> String {
    let lower = name.to_ascii_lowercase().replace('-', "_");
    if lower == "root" {
        "start".to_string()
    } else if lower == "start" {
        // `start` is Lark's entry point; a GBNF rule of that name keeps its own.
        "start_".to_string()
    } else {
        lower
    }
}

/// Translates a GBNF grammar into Lark.
pub fn to_lark(gbnf: &str) -> Result<String> {
    let src = gbnf.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    let mut rules = 0;
    let mut has_root = false;
    let is_name = |c: u8| c.is_ascii_alphanumeric() || c == b'-' || c == b'_';
    while i < src.len() {
        let c = src[i];
        match c {
            b'#' => {
                while i < src.len() && src[i] != b'\n' {
                    i += 1;
                }
            }
            b' ' | b'\t' | b'\r' | b'\n' => {
                // A newline ends a rule only where the next rule starts (`name ::=`), which is
                // found below; elsewhere whitespace separates items.
                if !out.ends_with(' ') && !out.ends_with('\n') && !out.is_empty() {
                    out.push(' ');
                }
                i += 1;
            }
            b'"' => {
                let start = i;
                i += 1;
                while i < src.len() && src[i] != b'"' {
                    if src[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                if i >= src.len() {
                    return Err(err(start, "a string literal is not closed"));
                }
                i += 1;
                out.push_str(&gbnf[start..i]);
            }
            b'[' => {
                let start = i;
                i += 1;
                while i < src.len() && src[i] != b']' {
                    if src[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                if i >= src.len() {
                    return Err(err(start, "a character class is not closed"));
                }
                i += 1;
                let class = &gbnf[start..i];
                out.push('/');
                out.push_str(&class.replace('/', "\\/"));
                out.push('/');
            }
            b'.' => {
                out.push_str("/(?s:.)/");
                i += 1;
            }
            b'(' | b')' | b'|' | b'*' | b'+' | b'?' => {
                out.push(c as char);
                i += 1;
            }
            b'{' => {
                let start = i;
                while i < src.len() && src[i] != b'}' {
                    if !(src[i].is_ascii_digit() || matches!(src[i], b'{' | b',' | b' ')) {
                        return Err(err(i, "a repetition must look like {m}, {m,} or {m,n}"));
                    }
                    i += 1;
                }
                if i >= src.len() {
                    return Err(err(start, "a repetition is not closed"));
                }
                i += 1;
                out.push_str(&gbnf[start..i].replace(' ', ""));
            }
            c if is_name(c) => {
                let start = i;
                while i < src.len() && is_name(src[i]) {
                    i += 1;
                }
                let name = &gbnf[start..i];
                // A definition when `::=` follows.
                let mut j = i;
                while j < src.len() && matches!(src[j], b' ' | b'\t') {
                    j += 1;
                }
                if gbnf[j..].starts_with("::=") {
                    let name = rule_name(name);
                    has_root |= name == "start";
                    if rules > 0 {
                        out.truncate(out.trim_end().len());
                        out.push('\n');
                    }
                    out.push_str(&name);
                    out.push(':');
                    rules += 1;
                    i = j + 3;
                } else {
                    out.push_str(&rule_name(name));
                }
            }
            other => return Err(err(i, format!("unexpected character {:?}", other as char))),
        }
    }
    if rules == 0 {
        return Err(err(0, "no rules (`name ::= …`)"));
    }
    if !has_root {
        return Err(err(0, "no `root` rule: llama.cpp starts from `root`"));
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_classes_and_repetitions_translate() {
        let lark = to_lark(
            "# arithmetic\nroot ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= [0-9]{1,3} | \"(\" expr \")\"\nmy-rule ::= . [^\"/]+\n",
        )
        .expect("translates");
        assert_eq!(
            lark,
            "start: expr\nexpr: term ((\"+\" | \"-\") term)*\nterm: /[0-9]/{1,3} | \"(\" expr \")\"\nmy_rule: /(?s:.)/ /[^\"\\/]/+\n"
        );
    }

    #[test]
    fn mistakes_are_named() {
        for (bad, what) in [
            ("root ::= \"a", "string literal"),
            ("root ::= [a-z", "character class"),
            ("expr ::= \"a\"", "no `root` rule"),
            ("root ::= a ; b", "unexpected character"),
            ("", "no rules"),
        ] {
            let e = to_lark(bad).expect_err(bad).to_string();
            assert!(e.contains(what), "{bad}: {e}");
        }
    }
}
