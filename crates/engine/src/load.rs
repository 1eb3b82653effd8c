//! Building an engine: the one function that turns an opened GGUF file into an [`Engine`] on the
//! chosen device, with YaRN scaling, the KV cache options and the CPU kernel choices. Every
//! interface reaches it through `smolchat_serving::load`, which adds the tokenizer and template.

use smolchat_gguf::GgufSource;

use crate::backend::Backend;
use crate::cpu::attention::DecodePrefetch;
use crate::cpu::quant::Isa;
use crate::cpu::CpuBackend;
use crate::device::Device;
use crate::{Engine, EngineError, KvOptions, KvType, Model, Result};

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
        options.cpu.apply();
        let mut model = Model::load(src, progress)?;
        if let Some(yarn) = options.yarn {
            model.apply_yarn(yarn.factor, yarn.original_context);
        }
        Engine::on_backend(backend_for(device, model, options.kv.kv_type)?, options.kv)
    }
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
        crate::cpu::quant::isa::configure_isa(self.isa);
        crate::cpu::attention::configure_decode_prefetch(self.decode_prefetch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{self, SyntheticSpec};

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
    fn a_device_without_a_backend_is_refused() {
        let mut src = synthetic::build(&SyntheticSpec::tiny("llama")).expect("build");
        let err = match Engine::load(
            &mut src,
            Device::Cuda(0),
            &EngineOptions::default(),
            &mut |_, _| {},
        ) {
            Ok(_) => panic!("no CUDA backend in this build"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("cuda"), "{err}");
    }
}
