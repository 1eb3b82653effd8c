//! The one place a chat prompt is made: messages and render options through the model's chat
//! template (the users' text guarded, so it can never become a control token), then tokenized.
//! The session actors (pages and the JSON API), `/v1` and the command line all call
//! [`PromptBuilder::build`], so one conversation becomes the same token ids whichever interface
//! sent it.

use super::template::{prompt_ends_in_open_think, ChatMessage, ChatTemplate, RenderOptions};
use super::tokenizer::Tokenizer;
use crate::error::Result;

/// A built prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// The token ids the model is fed.
    pub tokens: Vec<u32>,
    /// The rendered text (the template's output before tokenizing).
    pub text: String,
    /// Whether the prompt ends inside an open `<think>` block, so the reply starts in reasoning.
    pub starts_in_reasoning: bool,
}

/// A model's chat template and tokenizer, borrowed to build prompts.
#[derive(Clone, Copy)]
pub struct PromptBuilder<'a> {
    template: &'a ChatTemplate,
    tokenizer: &'a Tokenizer,
}

impl<'a> PromptBuilder<'a> {
    pub fn new(template: &'a ChatTemplate, tokenizer: &'a Tokenizer) -> Self {
        Self {
            template,
            tokenizer,
        }
    }

    /// Renders `messages` with `options` and tokenizes the result: the template's special tokens
    /// parsed, the messages' own text kept as text. A template that refuses the messages (wrong
    /// role order, say) is a [`crate::TextError::Template`].
    pub fn build(&self, messages: &[ChatMessage], options: &RenderOptions) -> Result<Prompt> {
        let rendered =
            self.template
                .render_prompt(messages, options, self.tokenizer.text_guard())?;
        let tokens = self.tokenizer.encode_rendered(&rendered)?;
        let text = rendered.text().to_string();
        Ok(Prompt {
            starts_in_reasoning: prompt_ends_in_open_think(&text),
            tokens,
            text,
        })
    }
}
