//! Loading a model: the one function behind `serve`, every command-line command and `bench`, so
//! that each gets the same tokenizer override, YaRN scaling, KV cache options, device choice and
//! CPU kernel choices from the same configuration.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::attention::DecodePrefetch;
use super::backend::{Backend, CpuBackend};
use super::device::{self, Device, DeviceRequest};
use super::gguf::GgufSource;
use super::quant::Isa;
use super::template::ChatTemplate;
use super::tokenizer::Tokenizer;
use super::{Engine, EngineError, KvOptions, KvType, Model, Result};

/// YaRN context extension (SmolLM3: a factor of 2 extends its 64k training context to 128k).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    /// The context the model was trained on (default: the GGUF's context length).
    pub original_context: Option<usize>,
}

/// Choices for the CPU kernels. Each is decided once per process, when the first model loads;
/// the environment variables `SMOLCHAT_ISA` and `SMOLCHAT_DECODE_PREFETCH` override them so one
/// machine can compare paths without editing its configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// The best instruction set the quantized kernels may use (default: the best this CPU has).
    pub isa: Option<Isa>,
    /// How decode attention prefetches KV pages (default: chosen by the L1 data cache size).
    pub decode_prefetch: Option<DecodePrefetch>,
}

/// Everything that decides how a model file becomes an engine.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub device: DeviceRequest,
    /// A `tokenizer.json` used instead of the GGUF's vocabulary.
    pub tokenizer_json: Option<PathBuf>,
    pub yarn: Option<Yarn>,
    pub kv: KvOptions,
    pub cpu: CpuOptions,
}

/// A loaded model with what every interface needs beside it.
pub struct LoadedModel {
    pub engine: Engine,
    pub tokenizer: Tokenizer,
    /// The file's chat template, or why it has none usable (raw prompts still work).
    pub template: std::result::Result<ChatTemplate, EngineError>,
    /// Seconds from opening the file to a ready engine.
    pub load_s: f64,
}

/// Opens `path` and loads it with `options`; `progress(done, total)` reports bytes of weights.
pub fn load(
    path: &Path,
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<LoadedModel> {
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
) -> Result<LoadedModel> {
    let device = device::select(options.device)?;
    load_on(src, device, options, progress, Instant::now())
}

/// The tokenizer `options` ask for: the `tokenizer.json` override, else the GGUF's vocabulary.
pub fn tokenizer(src: &GgufSource, tokenizer_json: Option<&Path>) -> Result<Tokenizer> {
    match tokenizer_json {
        Some(json) => Tokenizer::from_json_file(json, src),
        None => Tokenizer::from_gguf(src),
    }
}

fn load_on(
    mut src: GgufSource,
    device: Device,
    options: &LoadOptions,
    progress: &mut dyn FnMut(u64, u64),
    start: Instant,
) -> Result<LoadedModel> {
    options.cpu.apply();
    let tokenizer = tokenizer(&src, options.tokenizer_json.as_deref())?;
    let template = ChatTemplate::from_gguf(&src);
    let mut model = Model::load(&mut src, progress)?;
    if let Some(yarn) = options.yarn {
        model.apply_yarn(yarn.factor, yarn.original_context);
    }
    let engine = Engine::on_backend(backend_for(device, model, options.kv.kv_type)?, options.kv)?;
    Ok(LoadedModel {
        engine,
        tokenizer,
        template,
        load_s: start.elapsed().as_secs_f64(),
    })
}

/// The backend that computes on `device`: where a new backend plugs in.
fn backend_for(device: Device, model: Model, kv_type: KvType) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Box::new(CpuBackend::new(model, kv_type)?)),
        // `device::select` hands out only devices with a backend; this is its other half.
        Device::Cuda(n) => Err(EngineError::Device(
            device.to_string(),
            format!("this build has no CUDA engine backend yet (GPU {n} was chosen)"),
        )),
    }
}

impl CpuOptions {
    /// Sets the process's kernel choices (the first call decides; the environment overrides).
    pub fn apply(&self) {
        super::quant::isa::configure_isa(self.isa);
        super::attention::configure_decode_prefetch(self.decode_prefetch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::synthetic::{self, SyntheticSpec};

    #[test]
    fn yarn_and_kv_options_reach_the_engine() {
        let spec = SyntheticSpec::tiny("llama").with_placeholder_tokenizer();
        let plain = load_source(
            synthetic::build(&spec).expect("build"),
            &LoadOptions::default(),
            &mut |_, _| {},
        )
        .expect("load");
        let options = LoadOptions {
            device: DeviceRequest::Cpu,
            yarn: Some(Yarn {
                factor: 2.0,
                original_context: None,
            }),
            kv: KvOptions {
                kv_type: crate::engine::KvType::F32,
                budget_bytes: 1 << 20,
            },
            ..LoadOptions::default()
        };
        let scaled = load_source(
            synthetic::build(&spec).expect("build"),
            &options,
            &mut |_, _| {},
        )
        .expect("load");
        assert_eq!(scaled.engine.kv_type(), crate::engine::KvType::F32);
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
