//! A generated model (ordered metadata and tensors) and what is done with whole models: build it
//! in memory, write it or any source as a file, relabel its architecture.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use rayon::prelude::*;

use super::weights::generate_tensor;
use super::writer::{io_error, write_gguf_file, TensorInfo};
use super::{layer_of, SyntheticSpec};
use crate::error::{EngineError, Result};
use smolchat_gguf::{GgmlDType, GgufSource, RawTensor, Value};

/// A generated model: ordered metadata and tensors, ready to become a [`GgufSource`] or a file.
pub struct SyntheticModel {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<RawTensor>,
}

impl SyntheticModel {
    pub fn generate(spec: &SyntheticSpec) -> Result<Self> {
        let plan = spec.tensor_plan()?;
        let start = std::time::Instant::now();
        let tensors = plan
            .par_iter()
            .map(|p| generate_tensor(spec, p))
            .collect::<Result<Vec<_>>>()?;
        let model = Self {
            metadata: spec.metadata(),
            tensors,
        };
        tracing::debug!(
            arch = %spec.arch,
            tensors = model.tensors.len(),
            bytes = model.total_bytes(),
            elapsed_ms = start.elapsed().as_millis() as u64,
            "generated synthetic model"
        );
        Ok(model)
    }

    /// Bytes of tensor data (what the loaded model will hold).
    pub fn total_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }

    /// Relabels the model as another architecture: `general.architecture` and every
    /// `{old}.` key. The tensors are untouched.
    pub fn set_architecture(&mut self, arch: &str) {
        let old = arch_of(self.metadata.iter().map(|(k, v)| (k.as_str(), v)));
        for (k, v) in self.metadata.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String(arch.to_string());
            } else if let Some(new) = old.as_deref().and_then(|o| renamed_key(k, o, arch)) {
                *k = new;
            }
        }
    }

    pub fn into_source(self) -> GgufSource {
        GgufSource::in_memory(self.metadata.into_iter().collect(), self.tensors)
    }

    /// Writes the model as a GGUF (version 3) file.
    pub fn write_gguf(&self, path: &Path) -> Result<()> {
        let meta: Vec<(&str, &Value)> =
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let infos: Vec<TensorInfo> = self
            .tensors
            .iter()
            .map(|t| TensorInfo {
                name: &t.name,
                dtype: t.dtype,
                dims: &t.dims,
                n_bytes: t.data.len(),
            })
            .collect();
        write_gguf_file(path, &meta, &infos, |i, w| {
            w.write_all(self.tensors[i].data.as_slice())
                .map_err(|e| io_error(path, e))
        })
    }
}

/// Builds the model in memory.
pub fn build(spec: &SyntheticSpec) -> Result<GgufSource> {
    Ok(SyntheticModel::generate(spec)?.into_source())
}

/// Builds the model and writes it as a GGUF file.
pub fn write_gguf(spec: &SyntheticSpec, path: &Path) -> Result<()> {
    SyntheticModel::generate(spec)?.write_gguf(path)
}

/// Writes any source (edited metadata included) as a GGUF file, one tensor at a time. A
/// memory-backed source gives its tensors up in the process (that is how [`GgufSource`] hands
/// out tensor bytes), so use it once; a file-backed one is only read.
pub fn write_source_as_gguf(src: &mut GgufSource, path: &Path) -> Result<()> {
    write_converted(src, path, None)
}

/// Writes `src` as a GGUF file with every block-quantized tensor re-quantized to `to`
/// (dequantized to f32, then quantized by candle): a second quantization of a real model (the
/// float tensors, the norms and biases, are kept). `to` must be a block type whose block
/// divides every quantized tensor's rows (`q8_0` does for every GGUF block type).
pub fn requantize_as_gguf(src: &mut GgufSource, path: &Path, to: GgmlDType) -> Result<()> {
    write_converted(src, path, Some(to))
}

/// A tensor's type once written: `to` for block-quantized ones, its own otherwise.
fn converted_type(dtype: GgmlDType, to: Option<GgmlDType>) -> GgmlDType {
    match (dtype, to) {
        (GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16, _) | (_, None) => dtype,
        (_, Some(to)) => to,
    }
}

/// One tensor's bytes re-quantized from `from` to `to` (a flat run of blocks either way: rows
/// are whole blocks in both).
fn requantize(data: &[u8], from: GgmlDType, to: GgmlDType, elems: usize) -> Result<Vec<u8>> {
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
    let cpu = candle_core::Device::Cpu;
    let q = qtensor_from_ggml(from, data, vec![elems], &cpu)?;
    let floats = q.dequantize(&cpu)?;
    Ok(QTensor::quantize(&floats, to)?.data()?.into_owned())
}

fn write_converted(src: &mut GgufSource, path: &Path, to: Option<GgmlDType>) -> Result<()> {
    let mut keys: Vec<&String> = src.metadata.keys().collect();
    // A stable order (general.* first, as llama.cpp writes) makes the file reproducible.
    keys.sort_by_key(|k| (!k.starts_with("general."), k.as_str()));
    let meta_owned: Vec<(String, Value)> = keys
        .into_iter()
        .filter_map(|k| src.metadata.get(k).map(|v| (k.clone(), v.clone())))
        .collect();
    let meta: Vec<(&str, &Value)> = meta_owned.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut names: Vec<String> = src.tensors.keys().cloned().collect();
    names.sort_by_key(|n| tensor_order(n));
    // (name, type written, dims, bytes written, type read)
    let entries: Vec<(String, GgmlDType, Vec<usize>, usize, GgmlDType)> = names
        .iter()
        .filter_map(|n| {
            src.tensors.get(n).map(|e| {
                let dtype = converted_type(e.dtype, to);
                let n_bytes = if dtype == e.dtype {
                    e.n_bytes
                } else {
                    let elems: usize = e.dims.iter().product();
                    elems / dtype.block_size() * dtype.type_size()
                };
                (n.clone(), dtype, e.dims.clone(), n_bytes, e.dtype)
            })
        })
        .collect();
    let infos: Vec<TensorInfo> = entries
        .iter()
        .map(|(name, dtype, dims, n_bytes, _)| TensorInfo {
            name,
            dtype: *dtype,
            dims,
            n_bytes: *n_bytes,
        })
        .collect();
    write_gguf_file(path, &meta, &infos, |i, w| {
        let t = src.take_tensor(&entries[i].0)?;
        let (dtype, from) = (entries[i].1, entries[i].4);
        if dtype != from {
            let elems: usize = t.dims.iter().product();
            let data = requantize(t.data.as_slice(), from, dtype, elems)?;
            return w.write_all(&data).map_err(|e| io_error(path, e));
        }
        if t.data.len() != entries[i].3 {
            return Err(EngineError::InvalidStep(format!(
                "tensor `{}` holds {} bytes but its directory entry says {}",
                t.name,
                t.data.len(),
                entries[i].3
            )));
        }
        w.write_all(t.data.as_slice())
            .map_err(|e| io_error(path, e))
    })
}

/// Relabels a source's metadata as another architecture (`general.architecture` and every
/// `{old}.` key), e.g. to run smollm3 weights as llama without writing a file.
pub fn rename_architecture(metadata: &mut HashMap<String, Value>, arch: &str) {
    let old = arch_of(metadata.iter().map(|(k, v)| (k.as_str(), v)));
    if let Some(old) = old {
        let moved: Vec<String> = metadata
            .keys()
            .filter(|k| renamed_key(k, &old, arch).is_some())
            .cloned()
            .collect();
        for k in moved {
            if let (Some(v), Some(new)) = (metadata.remove(&k), renamed_key(&k, &old, arch)) {
                metadata.insert(new, v);
            }
        }
    }
    metadata.insert(
        "general.architecture".to_string(),
        Value::String(arch.to_string()),
    );
}

fn arch_of<'a>(mut meta: impl Iterator<Item = (&'a str, &'a Value)>) -> Option<String> {
    meta.find_map(|(k, v)| match (k, v) {
        ("general.architecture", Value::String(s)) => Some(s.clone()),
        _ => None,
    })
}

fn renamed_key(key: &str, old: &str, new: &str) -> Option<String> {
    let rest = key.strip_prefix(old)?.strip_prefix('.')?;
    Some(format!("{new}.{rest}"))
}

/// llama.cpp's order: embeddings and output first, then layers in numeric (not string) order.
fn tensor_order(name: &str) -> (usize, usize, String) {
    match layer_of(name) {
        Some(i) => (1, i, name.to_string()),
        None => (0, 0, name.to_string()),
    }
}
