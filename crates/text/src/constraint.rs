//! Constrained decoding: a per-sequence token mask that keeps the output inside a JSON Schema,
//! any JSON object, a Lark grammar or a regular expression, computed by llguidance (the library
//! llama.cpp and mistral.rs use) over this tokenizer's vocabulary.
//!
//! [`Constraint::new`] compiles a [`Grammar`] (a bad schema or grammar is the client's error,
//! caught before anything is queued by [`check`]); [`Generation`](crate::generation) asks for
//! the mask before each draw, sets every other token's logit to -inf, and feeds the drawn token
//! back. When the grammar is complete only end-of-generation stays allowed, so a constrained
//! reply always parses. llguidance bounds the work of each mask (its `ParserLimits` fuel), so a
//! hostile grammar fails a request instead of stalling the model thread.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

use crate::error::{Result, TextError};
use crate::tokenizer::Tokenizer;

/// What a reply must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Grammar {
    /// Any JSON object (OpenAI's `json_object` mode, Ollama's `format: "json"`).
    JsonObject,
    /// A JSON Schema (OpenAI's `json_schema`, llama-server's `json_schema`, Ollama's schema).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole reply must match.
    Regex(String),
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        }
    }
}

/// The largest grammar or schema accepted, in bytes of its text (a few hundred kilobytes of
/// schema compile in well under a second; more is refused before compiling).
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// The parser factory over `tokenizer`'s vocabulary, built on first use and kept with the
/// tokenizer.
pub fn factory_for(tokenizer: &Tokenizer) -> Result<Arc<ParserFactory>> {
    tokenizer
        .grammar_cache()
        .get_or_init(|| factory(tokenizer).map_err(|e| e.to_string()))
        .clone()
        .map_err(TextError::Constraint)
}

/// Builds the parser factory over `tokenizer`'s vocabulary. Special tokens are marked as
/// llguidance expects, so a grammar never produces them as text.
fn factory(tokenizer: &Tokenizer) -> Result<Arc<ParserFactory>> {
    let vocab = tokenizer.vocab_size();
    let words: Vec<Vec<u8>> = (0..vocab as u32)
        .map(|id| {
            let bytes = tokenizer.token_bytes(id);
            if tokenizer.is_special(id) {
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(&bytes);
                marked
            } else {
                bytes
            }
        })
        .collect();
    // The token that ends a constrained reply: the one the template ends a turn with.
    let eos = tokenizer
        .eog_ids()
        .first()
        .copied()
        .or(tokenizer.eos_id())
        .ok_or_else(|| {
            TextError::Constraint(
                "the tokenizer has no end-of-generation token to end a constrained reply".into(),
            )
        })?;
    let info = TokRxInfo::new(vocab as u32, eos);
    let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
    let mut factory = ParserFactory::new_simple(&env)
        .map_err(|e| TextError::Constraint(format!("cannot index the vocabulary: {e}")))?;
    factory.quiet();
    Ok(Arc::new(factory))
}

/// The grammar of a reply that must be one tool call, `<tool_call>{"name": …, "arguments":
/// …}</tool_call>` as the templates write them, to one of `tools` (`(name, parameters schema)`),
/// with arguments that match that tool's schema. The markers are matched as the special tokens
/// they are when the vocabulary has them.
pub fn tool_call_grammar(tokenizer: &Tokenizer, tools: &[(String, Value)]) -> Grammar {
    let marker = |text: &str| match tokenizer.token_id(text) {
        Some(id) if tokenizer.is_special(id) => format!("<[{id}]>"),
        _ => serde_json::to_string(text).unwrap_or_default(),
    };
    let calls: Vec<Value> = tools
        .iter()
        .map(|(name, parameters)| {
            let arguments = if parameters.is_object() {
                parameters.clone()
            } else {
                serde_json::json!({"type": "object"})
            };
            serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    // Compact JSON with the usual separators (`{"name": "f", "arguments": {…}}`): flexible
    // whitespace lets a sampled call wander through blank lines until it runs out of tokens
    // (seen at temperature 1 with SmolLM2), and no reader of a call needs any.
    let schema = serde_json::json!({
        "anyOf": calls,
        "x-guidance": {
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        },
    });
    Grammar::Lark(format!(
        "start: {} call {}\ncall: %json {}\n",
        marker(crate::splitter::TOOL_CALL_OPEN),
        marker(crate::splitter::TOOL_CALL_CLOSE),
        schema
    ))
}

/// A reply's constraint: the grammar's parser state.
pub struct Constraint {
    matcher: Matcher,
    /// The next token's mask, when computed ahead ([`Constraint::prepare`]).
    ready: Option<toktrie::SimpleVob>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").finish_non_exhaustive()
    }
}

/// Compiles `grammar` for `tokenizer` and computes its first mask, or says what is wrong with
/// it (for a 400 before the request is queued): a grammar that compiles but allows no output at
/// all (a schema that only refers to itself, say) is refused here too.
pub fn check(tokenizer: &Tokenizer, grammar: &Grammar) -> Result<()> {
    let mut c = Constraint::new(tokenizer, grammar)?;
    let allowed = c.matcher.compute_mask_or_eos().map_err(|e| {
        TextError::Constraint(format!(
            "the grammar or schema allows no output ({e}); check its rules and references"
        ))
    })?;
    if allowed.is_zero() {
        return Err(TextError::Constraint(
            "the grammar or schema allows no output; check its rules and references".into(),
        ));
    }
    Ok(())
}

/// Whether the compiled grammar has any complete derivation: its start symbol is productive,
/// the least fixpoint of "a terminal (a lexeme, a nested grammar), nullable, or with a rule
/// whose symbols are all productive". A grammar that fails this has no end state: the mask
/// never allows end-of-generation, which would give anyone the effect of the admin-only
/// `ignore_eos` (every reply runs to max_tokens). A grammar that can end but only after a long
/// reply (a regex of 200 letters) is allowed: it ends where it says, and a reply past
/// max_tokens stops there like any other, under the same limits and quotas.
fn can_finish(g: &llguidance::earley::CGrammar) -> bool {
    use llguidance::earley::CSymIdx;
    use std::collections::HashSet;
    let start = g.start();
    // The symbols reachable from the start, in the order found.
    let mut reachable = vec![start];
    let mut seen = HashSet::from([start]);
    let mut i = 0;
    while i < reachable.len() {
        let sym = reachable[i];
        i += 1;
        for &rule in &g.sym_data(sym).rules {
            for &next in g.rule_rhs(rule).0 {
                if next != CSymIdx::NULL && seen.insert(next) {
                    reachable.push(next);
                }
            }
        }
    }
    let mut productive: HashSet<CSymIdx> = HashSet::new();
    loop {
        let mut changed = false;
        for &sym in &reachable {
            if productive.contains(&sym) {
                continue;
            }
            let d = g.sym_data(sym);
            let ends = d.is_terminal
                || d.is_nullable
                || d.lexeme.is_some()
                || d.gen_grammar.is_some()
                || d.rules.iter().any(|&rule| {
                    g.rule_rhs(rule)
                        .0
                        .iter()
                        .all(|s| *s == CSymIdx::NULL || productive.contains(s))
                });
            if ends {
                productive.insert(sym);
                changed = true;
            }
        }
        if !changed {
            return productive.contains(&start);
        }
    }
}

impl Constraint {
    pub fn new(tokenizer: &Tokenizer, grammar: &Grammar) -> Result<Self> {
        let size = match grammar {
            Grammar::JsonObject => 0,
            Grammar::JsonSchema(v) => v.to_string().len(),
            Grammar::Lark(s) | Grammar::Regex(s) => s.len(),
        };
        if size > MAX_GRAMMAR_BYTES {
            return Err(TextError::Constraint(format!(
                "the grammar or schema is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted"
            )));
        }
        let factory = factory_for(tokenizer)?;
        // A compiler fault on some input must be that request's error, never a panic on the
        // model thread.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            factory.create_parser(grammar.top_level())
        }))
        .map_err(|panic| {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no detail");
            TextError::Constraint(format!(
                "the grammar or schema could not be compiled ({what}); simplify it"
            ))
        })?;
        if parser
            .as_ref()
            .is_ok_and(|p| !can_finish(p.parser.grammar()))
        {
            return Err(TextError::Constraint(
                "the grammar can never be complete: every way through its start rule refers to \
                 itself again (e.g. `x: \"ab\" x` has no way out), so a reply under it could only \
                 run until max_tokens; give each recursion an alternative that ends (`x: \"ab\" x \
                 | \"ab\"`)"
                    .into(),
            ));
        }
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(TextError::Constraint(e));
        }
        Ok(Self {
            matcher,
            ready: None,
        })
    }

    /// Computes the next token's mask ahead of time (it depends only on the tokens consumed so
    /// far), so the model worker can do it while the forward pass runs; [`Self::mask`] then uses
    /// it.
    pub fn prepare(&mut self) -> Result<()> {
        if self.ready.is_none() {
            let allowed = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| TextError::Constraint(e.to_string()))?;
            self.ready = Some(allowed);
        }
        Ok(())
    }

    /// Sets the logit of every token the grammar does not allow next to -inf (only
    /// end-of-generation once the grammar is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = match self.ready.take() {
            Some(allowed) => allowed,
            None => self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| TextError::Constraint(e.to_string()))?,
        };
        for (id, l) in logits.iter_mut().enumerate() {
            if !allowed.is_allowed(id as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Records the drawn token.
    pub fn consume(&mut self, token: u32) -> Result<()> {
        self.ready = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| TextError::Constraint(e.to_string()))
    }

    /// Whether the grammar is complete (only end-of-generation may follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smolchat_engine::synthetic::{self, SyntheticSpec};

    fn tokenizer() -> Tokenizer {
        let spec = SyntheticSpec::tiny("llama").with_placeholder_tokenizer();
        let src = synthetic::build(&spec).expect("synthetic model");
        Tokenizer::from_gguf(&src).expect("placeholder tokenizer")
    }

    /// How many of `text`'s tokens the grammar accepts.
    fn accepted(tok: &Tokenizer, grammar: &Grammar, text: &str) -> (usize, usize) {
        let mut c = Constraint::new(tok, grammar).expect("compiles");
        let ids = tok.encode(text, false).expect("encode");
        let n = c.matcher.validate_tokens(&ids).expect("validate");
        (n, ids.len())
    }

    #[test]
    fn a_forced_tool_call_is_compact_json_naming_an_offered_tool() {
        let tok = tokenizer();
        let params = serde_json::json!({
            "type": "object",
            "properties": {"country": {"type": "string"}},
            "required": ["country"],
        });
        let grammar = tool_call_grammar(&tok, &[("get_capital".into(), params)]);
        let call = |json: &str| {
            format!(
                "{}{json}{}",
                crate::splitter::TOOL_CALL_OPEN,
                crate::splitter::TOOL_CALL_CLOSE
            )
        };
        let good = call(r#"{"name": "get_capital", "arguments": {"country": "France"}}"#);
        let (n, all) = accepted(&tok, &grammar, &good);
        assert_eq!(n, all, "the canonical call is accepted whole");
        for bad in [
            r#"{ "name": "get_capital", "arguments": {"country": "France"}}"#,
            r#"{"name": "get_capital",
 "arguments": {"country": "France"}}"#,
            r#"{"name": "other", "arguments": {"country": "France"}}"#,
            r#"{"name": "get_capital", "arguments": {"city": "Paris"}}"#,
        ] {
            let (n, all) = accepted(&tok, &grammar, &call(bad));
            assert!(n < all, "refused: {bad}");
        }
    }

    #[test]
    fn a_grammar_that_can_never_end_is_refused_and_one_that_can_is_not() {
        let tok = tokenizer();
        for never in [
            "start: x\nx: \"ab\" x",
            "start: x\nx: (\"ab\" | \"cd\") y\ny: \"e\" x",
        ] {
            let e = Constraint::new(&tok, &Grammar::Lark(never.into()))
                .err()
                .map(|e| e.to_string());
            assert!(
                e.as_deref()
                    .is_some_and(|e| e.contains("never be complete")),
                "{never}: {e:?}"
            );
        }
        for ends in [
            "start: x\nx: \"ab\" x | \"ab\"",
            "start: x*\nx: \"ab\"",
            "start: \"a\" y\ny: y \"b\" | \"c\"",
        ] {
            assert!(
                Constraint::new(&tok, &Grammar::Lark(ends.into())).is_ok(),
                "{ends}"
            );
        }
        assert!(Constraint::new(&tok, &Grammar::Regex("[a-z]{200}".into())).is_ok());
        assert!(Constraint::new(&tok, &Grammar::JsonObject).is_ok());
    }
}
