//! Loading a model: the one function behind `serve`, every command-line command and `bench`, so
//! that each gets the same tokenizer override, YaRN scaling, KV cache options, device choice and
//! CPU kernel choices from the same configuration.

use std::path::{Path, PathBuf};
use std::time::Instant;

use smolchat_engine::device::{self, Device, DeviceRequest};
use smolchat_engine::{Engine, EngineError, EngineOptions};
use smolchat_gguf::{GgufError, GgufSource};
use smolchat_text::template::ChatTemplate;
use smolchat_text::tokenizer::Tokenizer;
use smolchat_text::TextError;

/// Why a model did not load: the file, the engine (weights, device, KV options) or its text
/// side (vocabulary, tokenizer override).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Text(#[from] TextError),
}

impl From<GgufError> for LoadError {
    fn from(e: GgufError) -> Self {
        LoadError::Engine(e.into())
    }
}

/// Everything that decides how a model file becomes an engine with its tokenizer.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub device: DeviceRequest,
    /// A `tokenizer.json` used instead of the GGUF's vocabulary.
    pub tokenizer_json: Option<PathBuf>,
    pub engine: EngineOptions,
}

/// A loaded model with what every interface needs beside it.
pub struct LoadedModel {
    pub engine: Engine,
    pub tokenizer: Tokenizer,
    /// The file's chat template, or why it has none usable (raw prompts still work).
    pub template: Result<ChatTemplate, TextError>,
    /// Seconds from opening the file to a ready engine.
    pub load_s: f64,
}

/// Opens `path` and loads it with `options`; `progress(done, total)` reports bytes of weights.
pub fn load(
    path: &Path,
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedModel, LoadError> {
    // Before the (slow) load: a device that cannot be used is an error, not a silent fall-back.
    let device = device::select(options.device)?;
    let start = Instant::now();
    let src = GgufSource::open(path)?;
    load_on(src, device, options, progress, start)
}

/// Loads an already opened source (a synthetic model, say) with `options`.
pub fn load_source(
    src: GgufSource,
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedModel, LoadError> {
    let device = device::select(options.device)?;
    load_on(src, device, options, progress, Instant::now())
}

fn load_on(
    mut src: GgufSource,
    device: Device,
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
    start: Instant,
) -> Result<LoadedModel, LoadError> {
    let tokenizer = Tokenizer::load(&src, options.tokenizer_json.as_deref())?;
    let template = ChatTemplate::from_gguf(&src);
    let engine = Engine::load(&mut src, device, &options.engine, progress)?;
    Ok(LoadedModel {
        engine,
        tokenizer,
        template,
        load_s: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use smolchat_engine::synthetic::{self, SyntheticSpec};
    use smolchat_engine::{KvOptions, KvType, Yarn};

    #[test]
    fn every_option_reaches_the_engine() {
        let spec = SyntheticSpec::tiny("llama").with_placeholder_tokenizer();
        let plain = load_source(
            synthetic::build(&spec).expect("build"),
            &LoadOptions::default(),
            &mut |_, _| {},
        )
        .expect("load");
        let options = LoadOptions {
            device: DeviceRequest::Cpu,
            engine: EngineOptions {
                yarn: Some(Yarn {
                    factor: 2.0,
                    original_context: None,
                }),
                kv: KvOptions {
                    kv_type: KvType::F32,
                    budget_bytes: Some(1 << 20),
                },
                ..EngineOptions::default()
            },
            ..LoadOptions::default()
        };
        let scaled = load_source(
            synthetic::build(&spec).expect("build"),
            &options,
            &mut |_, _| {},
        )
        .expect("load");
        assert_eq!(scaled.engine.kv_type(), KvType::F32);
        assert!(scaled.engine.kv_capacity_blocks() * scaled.engine.kv_block_bytes() <= 1 << 20);
        assert_eq!(scaled.engine.device(), Device::Cpu);
        assert_eq!(
            scaled.engine.config().context_length,
            2 * plain.engine.config().context_length,
            "YaRN with factor 2 doubles the context window"
        );
    }

    #[test]
    fn a_missing_tokenizer_override_is_an_error_naming_it() {
        let options = LoadOptions {
            tokenizer_json: Some(PathBuf::from("/nonexistent/tokenizer.json")),
            ..LoadOptions::default()
        };
        let err = match load_source(
            synthetic::build(&SyntheticSpec::tiny("llama").with_placeholder_tokenizer())
                .expect("build"),
            &options,
            &mut |_, _| {},
        ) {
            Ok(_) => panic!("a missing tokenizer.json must not load"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}
