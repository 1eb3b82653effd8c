//! Building an engine: the one function that turns an opened GGUF file into an [`Engine`] on the
//! chosen device, with YaRN scaling, the KV cache options and the CPU kernel choices. Every
//! interface reaches it through `smolchat_serving::load`, which adds the tokenizer and template.

use smolchat_gguf::GgufSource;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::cpu::attention::DecodePrefetch;
use crate::cpu::quant::Isa;
use crate::cpu::CpuBackend;
use crate::device::{Device, GpuTier};
use crate::fast::weights::FastWeights;
#[cfg(feature = "cuda")]
use crate::fast::FastBackend;
use crate::kv::KvType;
use crate::reference::ReferenceBackend;
use crate::selfcheck;
use crate::{Engine, EngineError, KvOptions, Model, Result};

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

/// Everything that decides how a model file becomes an engine, besides the device.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    pub yarn: Option<Yarn>,
    pub kv: KvOptions,
    pub cpu: CpuOptions,
    /// Which path runs the model on a GPU.
    pub gpu_tier: GpuTier,
    /// Whether the fast tier replays decode steps from CUDA graphs.
    pub gpu_graphs: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            yarn: None,
            kv: KvOptions::default(),
            cpu: CpuOptions::default(),
            gpu_tier: GpuTier::default(),
            gpu_graphs: true,
        }
    }
}

impl Engine {
    /// Loads the weights of `src` onto `device` and builds the engine with `options`;
    /// `progress(done, total)` reports bytes of weights.
    pub fn load(
        src: &mut GgufSource,
        device: Device,
        options: &EngineOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Engine> {
        let (backend, note) = backend_for(src, device, options, progress)?;
        let engine = Engine::on_backend(backend, options.kv)?;
        Ok(match note {
            Some(note) => engine.with_note(note),
            None => engine,
        })
    }
}

/// A backend, and why it is not the tier asked for when that happened.
type Loaded = (Box<dyn Backend>, Option<String>);

/// Loads `src` onto the backend that computes on `device`: where a new backend plugs in. With it
/// comes why it is not the tier asked for, when that happened.
fn backend_for(
    src: &mut GgufSource,
    device: Device,
    options: &EngineOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Loaded> {
    let yarn = |config: &mut ModelConfig| {
        if let Some(y) = options.yarn {
            config.apply_yarn(y.factor, y.original_context);
        }
    };
    match device {
        Device::Cpu => {
            options.cpu.apply();
            let mut model = Model::load(src, progress)?;
            yarn(&mut model.config);
            Ok((Box::new(CpuBackend::new(model, options.kv.kv_type)?), None))
        }
        Device::Cuda(n) => {
            let dev = candle_core::Device::new_cuda(n).map_err(|e| {
                EngineError::Device(device.to_string(), format!("cannot open the GPU: {e}"))
            })?;
            let mut config = ModelConfig::from_gguf(src)?;
            yarn(&mut config);
            gpu_backend(src, config, n, dev, options, progress)
        }
    }
}

/// The backend on GPU `ordinal` for `options.gpu_tier` (see [`GpuTier`]), and why, when it is
/// not the tier asked for.
fn gpu_backend(
    src: &mut GgufSource,
    config: ModelConfig,
    ordinal: usize,
    dev: candle_core::Device,
    options: &EngineOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Loaded> {
    let device = Device::Cuda(ordinal);
    let reference = |src: &mut GgufSource, config, dev, progress: &mut dyn FnMut(u64, u64)| {
        ReferenceBackend::load(src, config, device, dev, options.kv.kv_type, progress)
            .map(|b| Box::new(b) as Box<dyn Backend>)
    };
    let unfit = match (
        crate::fast::weights::runs(src),
        options.kv.kv_type == KvType::F16,
    ) {
        (Err(why), _) => Some(why),
        (Ok(()), false) => Some(format!(
            "the fast tier stores the KV cache as f16, and model.kv_type is {}",
            options.kv.kv_type
        )),
        (Ok(()), true) => None,
    };
    match (options.gpu_tier, unfit) {
        (GpuTier::Reference, _) => Ok((reference(src, config, dev, progress)?, None)),
        (GpuTier::Fast, Some(why)) => Err(EngineError::Device(
            device.to_string(),
            format!(
                "model.gpu_tier = \"fast\" cannot run this: {why}; use \"auto\" or \"reference\""
            ),
        )),
        (GpuTier::Auto, Some(why)) => {
            let note = format!("reference tier: {why}");
            tracing::warn!("{note}");
            Ok((reference(src, config, dev, progress)?, Some(note)))
        }
        (tier, None) => {
            let weights = FastWeights::load(src, config, progress)?;
            let checked = (tier == GpuTier::Auto)
                .then(|| ReferenceBackend::from_weights(&weights, device, dev))
                .transpose()?;
            let fast = fast_cuda(weights, ordinal, options.gpu_graphs)?;
            let Some(reference) = checked else {
                return Ok((fast, None));
            };
            let selfcheck::Checked {
                check,
                fast,
                reference,
            } = selfcheck::compare(fast, Box::new(reference))?;
            if check.passed() {
                tracing::info!(%check, "the fast tier passed its self-check against the reference tier");
                Ok((fast, None))
            } else {
                let note = format!("reference tier: the fast tier failed its self-check ({check})");
                tracing::error!("{note}");
                Ok((reference, Some(note)))
            }
        }
    }
}

/// The fast tier on GPU `ordinal`.
#[cfg(feature = "cuda")]
fn fast_cuda(weights: FastWeights, ordinal: usize, graphs: bool) -> Result<Box<dyn Backend>> {
    Ok(Box::new(FastBackend::new(
        crate::fast::cuda::CudaRunner::load(weights, ordinal, graphs)?,
    )))
}

/// Without the `cuda` feature no GPU opens, so this is never reached.
#[cfg(not(feature = "cuda"))]
fn fast_cuda(_weights: FastWeights, ordinal: usize, _graphs: bool) -> Result<Box<dyn Backend>> {
    Err(EngineError::Device(
        Device::Cuda(ordinal).to_string(),
        "this build has no CUDA fast tier (build with `make cuda`)".into(),
    ))
}

impl CpuOptions {
    /// Sets the process's kernel choices (the first call decides; the environment overrides).
    pub fn apply(&self) {
        crate::cpu::quant::isa::configure_isa(self.isa);
        crate::cpu::attention::configure_decode_prefetch(self.decode_prefetch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{self, SyntheticSpec};
    use crate::KvType;

    fn load(options: &EngineOptions) -> Engine {
        let mut src = synthetic::build(&SyntheticSpec::tiny("llama")).expect("build");
        Engine::load(&mut src, Device::Cpu, options, &mut |_, _| {}).expect("load")
    }

    #[test]
    fn yarn_and_kv_options_reach_the_engine() {
        let plain = load(&EngineOptions::default());
        let scaled = load(&EngineOptions {
            yarn: Some(Yarn {
                factor: 2.0,
                original_context: None,
            }),
            kv: KvOptions {
                kv_type: KvType::F32,
                budget_bytes: Some(1 << 20),
            },
            ..EngineOptions::default()
        });
        assert_eq!(scaled.kv_type(), KvType::F32);
        assert!(scaled.kv_capacity_blocks() * scaled.kv_block_bytes() <= 1 << 20);
        assert_eq!(scaled.device(), Device::Cpu);
        assert_eq!(
            scaled.config().context_length,
            2 * plain.config().context_length,
            "YaRN with factor 2 doubles the context window"
        );
    }

    #[test]
    fn a_gpu_that_cannot_be_opened_is_a_clear_error() {
        let mut src = synthetic::build(&SyntheticSpec::tiny("llama")).expect("build");
        let err = match Engine::load(
            &mut src,
            Device::Cuda(0),
            &EngineOptions::default(),
            &mut |_, _| {},
        ) {
            // On a machine with a GPU and the `cuda` feature it loads.
            Ok(_) if crate::device::probe_cuda().is_ok_and(|n| n > 0) => return,
            Ok(_) => panic!("no GPU here, yet CUDA loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("cuda:0") && err.contains("cannot open the GPU"),
            "{err}"
        );
    }
}
