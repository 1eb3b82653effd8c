//! The CPU backend: the Llama-family transformer ([`model`]) with its quantized matmul kernels
//! ([`quant`]) and paged attention ([`attention`]) over KV pages in host memory ([`kv`]), every
//! parallel region on the rayon pool.

pub mod attention;
mod awake;
pub mod kv;
mod math;
pub mod model;
pub mod quant;

pub use attention::DecodePrefetch;
pub use quant::Isa;

use crate::backend::BatchItem;
use crate::backend::{Backend, Suggested};
use crate::config::ModelConfig;
use crate::device::{Device, Tier};
use crate::error::{EngineError, Result};
use crate::kv::{BlockId, KvLayout, KvType};
use crate::logits::Logits;
use kv::CpuKvStorage;
use model::Model;

/// The CPU backend: the model and its KV pages in host memory.
pub struct CpuBackend {
    model: Model,
    storage: CpuKvStorage,
}

impl CpuBackend {
    /// The backend for `model` storing KV rows as `kv_type`; errors when that type cannot store
    /// this model's rows.
    pub fn new(model: Model, kv_type: KvType) -> Result<Self> {
        KvLayout::new(&model.config, kv_type)
            .check()
            .map_err(EngineError::KvConfig)?;
        Ok(Self::with_layout(model, kv_type))
    }

    /// The backend for `model` storing f16 KV rows, which fit every row shape.
    pub fn f16(model: Model) -> Self {
        Self::with_layout(model, KvType::F16)
    }

    /// The backend for `model` storing `kv_type` rows, checked or known to fit.
    fn with_layout(model: Model, kv_type: KvType) -> Self {
        Self {
            storage: CpuKvStorage::new(KvLayout::new(&model.config, kv_type)),
            model,
        }
    }
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn tier(&self) -> Tier {
        Tier::Cpu
    }

    fn suggested(&self) -> Suggested {
        Suggested::CPU
    }

    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    fn kv_type(&self) -> KvType {
        self.storage.layout().kv_type
    }

    fn kv_bytes_per_position(&self) -> usize {
        self.storage.layout().bytes_per_position()
    }

    fn kv_block_bytes(&self) -> usize {
        self.storage.layout().bytes_per_block()
    }

    fn reserve_blocks(&mut self, blocks: usize, _capacity: usize) -> Result<()> {
        // Pages are allocated one by one: nothing to gain from taking more.
        self.storage.ensure(blocks);
        Ok(())
    }

    fn kv_resident_bytes(&self) -> usize {
        self.storage.resident_bytes()
    }

    fn validate(&self, items: &[BatchItem<'_>]) -> Result<()> {
        self.model.validate_request(items)
    }

    fn kv_block_format(&self) -> Option<String> {
        Some(format!("cpu-pages-{}-v1", self.storage.layout().kv_type))
    }

    fn read_kv_blocks(&mut self, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<()> {
        crate::backend::check_resident(blocks, self.storage.blocks())?;
        for &b in blocks {
            self.storage.export_block(b, out);
        }
        Ok(())
    }

    fn write_kv_blocks(&mut self, blocks: &[BlockId], bytes: &[u8]) -> Result<()> {
        crate::backend::check_resident(blocks, self.storage.blocks())?;
        let size = self.storage.layout().bytes_per_block();
        if bytes.len() != blocks.len() * size {
            return Err(EngineError::InvalidStep(format!(
                "{} bytes are not {} blocks of {size}",
                bytes.len(),
                blocks.len()
            )));
        }
        for (&b, chunk) in blocks.iter().zip(bytes.chunks_exact(size)) {
            self.storage.import_block(b, chunk);
        }
        Ok(())
    }

    fn forward(&mut self, items: &[BatchItem<'_>], out: &mut Logits) -> Result<()> {
        // Run the pass on a worker of the compute pool (parallel regions started from inside the
        // pool are much cheaper than ones injected from an outside thread), with the other
        // workers kept awake between its regions (`awake`).
        let model = &self.model;
        let storage = &mut self.storage;
        awake::run_awake(|| model.forward(storage, items, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{self, SyntheticSpec};
    use crate::{Engine, KvOptions, LogitsMode, SeqStep};

    fn model() -> Model {
        let mut src = synthetic::build(&SyntheticSpec::tiny("smollm3")).expect("build");
        Model::load(&mut src, &mut |_, _| {}).expect("load")
    }

    #[test]
    fn the_engine_runs_over_any_backend_with_the_same_results() {
        // A backend that passes everything to the CPU backend and records what the engine
        // asked: the engine needs nothing of a backend beyond the trait.
        let reserved = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let passes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (r, p) = (reserved.clone(), passes.clone());
        let backend = crate::backend::Watched {
            inner: Box::new(CpuBackend::new(model(), KvType::F16).expect("backend")),
            watch: Box::new(move |asked| match asked {
                crate::backend::Asked::Reserve(blocks) => r.lock().unwrap().push(blocks),
                crate::backend::Asked::Forward(items) => p.lock().unwrap().push(items.len()),
            }),
            rows_alike: None,
        };
        let mut through_trait =
            Engine::on_backend(Box::new(backend), KvOptions::default()).expect("engine");
        let mut direct = Engine::with_kv(model(), KvOptions::default()).expect("engine");
        let prompt: Vec<u32> = (1..40).collect();
        let mut logits = Vec::new();
        for engine in [&mut through_trait, &mut direct] {
            let a = engine.create_sequence();
            let b = engine.create_sequence();
            let out = engine
                .step(&[
                    SeqStep {
                        seq: a,
                        tokens: &prompt,
                        logits: LogitsMode::Last,
                    },
                    SeqStep {
                        seq: b,
                        tokens: &prompt[..5],
                        logits: LogitsMode::Last,
                    },
                ])
                .expect("step");
            logits.push(out);
        }
        assert_eq!(logits[0], logits[1], "the same pass through the trait");
        // One pass of two items; pages reserved for the blocks the step holds (39 + 5
        // positions: 3 + 1 blocks of 16).
        assert_eq!(*passes.lock().unwrap(), vec![2]);
        assert_eq!(*reserved.lock().unwrap(), vec![4]);
        assert_eq!(through_trait.device(), Device::Cpu);
        assert_eq!(
            through_trait.kv_block_bytes(),
            direct.kv_block_bytes(),
            "the backend's layout sets the allocator's block size"
        );
    }
}
