//! Text around the model: the tokenizer built from a GGUF, chat templates and the guard that keeps
//! user text from becoming control tokens, the one prompt builder, sampling, one request's
//! generation state (sampler, stops, detokenizer) and the streaming splitter into answer,
//! reasoning and tool calls. It knows nothing of the engine's backends, actors, SQL or HTTP.

pub mod constraint;
pub mod error;
pub mod gbnf;
pub mod generation;
pub mod guard;
pub mod prompt;
pub mod sampling;
pub mod splitter;
pub mod template;
pub mod tokenizer;

pub use error::{Result, TextError};
