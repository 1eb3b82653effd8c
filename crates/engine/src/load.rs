//! Building an engine: the one function that turns an opened GGUF file into an [`Engine`] on the
//! chosen device, with YaRN scaling, the KV cache options and the CPU kernel choices. Every
//! interface reaches it through `smolchat_serving::load`, which adds the tokenizer and template.

use smolchat_gguf::GgufSource;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::cpu::attention::DecodePrefetch;
use crate::cpu::quant::Isa;
use crate::cpu::CpuBackend;
use crate::device::Device;
use crate::reference::ReferenceBackend;
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
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineOptions {
    pub yarn: Option<Yarn>,
    pub kv: KvOptions,
    pub cpu: CpuOptions,
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
        Engine::on_backend(backend_for(src, device, options, progress)?, options.kv)
    }
}

/// Loads `src` onto the backend that computes on `device`: where a new backend plugs in.
fn backend_for(
    src: &mut GgufSource,
    device: Device,
    options: &EngineOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Box<dyn Backend>> {
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
            Ok(Box::new(CpuBackend::new(model, options.kv.kv_type)?))
        }
        Device::Cuda(n) => {
            let dev = candle_core::Device::new_cuda(n).map_err(|e| {
                EngineError::Device(device.to_string(), format!("cannot open the GPU: {e}"))
            })?;
            let mut config = ModelConfig::from_gguf(src)?;
            yarn(&mut config);
            Ok(Box::new(ReferenceBackend::load(
                src,
                config,
                device,
                dev,
                options.kv.kv_type,
                progress,
            )?))
        }
    }
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
                budget_bytes: 1 << 20,
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
