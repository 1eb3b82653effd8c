//! GGUF reading: metadata, tensor directory and raw tensor bytes.
//!
//! We parse the header ourselves (rather than through candle's reader) so that every way a file can
//! be wrong gets its own error naming the key or tensor at fault, and so that tensor bytes are read
//! straight into the buffers the model keeps, without an intermediate copy.
//! Metadata values use candle's `gguf_file::Value`, so candle's GGUF writer (used by the tests and by
//! `synthetic`) produces exactly what this reader reads.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

pub use candle_core::quantized::gguf_file::Value;
pub use candle_core::quantized::GgmlDType;

pub mod aligned;
mod error;

pub use aligned::AlignedBytes;
pub use error::{GgufError, Result};

/// Where a tensor's bytes live.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub dtype: GgmlDType,
    /// Row-major dimensions (outermost first): a weight matrix is `[rows = out, cols = in]`.
    pub dims: Vec<usize>,
    /// Byte offset in the file (absolute) for file-backed sources.
    offset: u64,
    pub n_bytes: usize,
}

impl TensorEntry {
    pub fn elem_count(&self) -> usize {
        self.dims.iter().product()
    }
}

/// The bytes of one tensor, 64-byte aligned so SIMD kernels and block casts are safe.
pub struct RawTensor {
    pub name: String,
    pub dtype: GgmlDType,
    pub dims: Vec<usize>,
    pub data: AlignedBytes,
}

enum Backing {
    File { path: PathBuf },
    Memory(HashMap<String, AlignedBytes>),
}

/// A GGUF model: metadata plus a directory of tensors, backed by a file or by memory.
pub struct GgufSource {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorEntry>,
    backing: Backing,
}

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Sanity bounds so a corrupt length field is an error, not an allocation of terabytes.
const MAX_STRING: u64 = 64 << 20;
const MAX_ARRAY: u64 = 1 << 28;

/// Bytes per block and elements per block of a GGML type, or `None` when the id is unknown.
pub fn dtype_from_id(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// llama.cpp's names for GGML type ids we cannot run, for error messages.
fn ggml_type_name(id: u32) -> String {
    let name = match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("unknown type id {id}"),
    };
    name.to_string()
}

struct HeaderReader<R> {
    inner: R,
    path: PathBuf,
    file_len: u64,
    pos: u64,
}

impl<R: Read> HeaderReader<R> {
    fn corrupt(&self, detail: impl Into<String>) -> GgufError {
        GgufError::Corrupt {
            path: self.path.clone(),
            detail: detail.into(),
        }
    }
    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if self
            .pos
            .checked_add(n)
            .is_none_or(|end| end > self.file_len)
        {
            return Err(self.corrupt(format!(
                "the header ends early while reading {what} at byte {}",
                self.pos
            )));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner.read_exact(&mut buf).map_err(|e| GgufError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        self.pos += n;
        Ok(buf)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.bytes(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > MAX_STRING {
            return Err(self.corrupt(format!("{what} claims a length of {len} bytes")));
        }
        let mut b = self.bytes(len, what)?;
        while b.last() == Some(&0) {
            b.pop();
        }
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<Value> {
        let v = match type_id {
            0 => Value::U8(self.bytes(1, key)?[0]),
            1 => Value::I8(self.bytes(1, key)?[0] as i8),
            2 => {
                let b = self.bytes(2, key)?;
                Value::U16(u16::from_le_bytes([b[0], b[1]]))
            }
            3 => {
                let b = self.bytes(2, key)?;
                Value::I16(i16::from_le_bytes([b[0], b[1]]))
            }
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(self.u32(key)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(key)?)),
            7 => Value::Bool(self.bytes(1, key)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(self.corrupt(format!("key `{key}` nests arrays too deeply")));
                }
                let elem_type = self.u32(key)?;
                let n = self.u64(key)?;
                if n > MAX_ARRAY {
                    return Err(self.corrupt(format!("key `{key}` claims {n} array elements")));
                }
                let mut items = Vec::with_capacity(n.min(1 << 20) as usize);
                for _ in 0..n {
                    items.push(self.value(elem_type, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(key)?)),
            other => {
                return Err(self.corrupt(format!("key `{key}` has unknown value type {other}")))
            }
        };
        Ok(v)
    }
}

impl GgufSource {
    /// Opens a GGUF file and reads its header. Tensor bytes are read later, one tensor at a time.
    pub fn open(path: &Path) -> Result<Self> {
        let io_err = |e| GgufError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let file = File::open(path).map_err(io_err)?;
        let file_len = file.metadata().map_err(io_err)?.len();
        let mut r = HeaderReader {
            inner: BufReader::with_capacity(1 << 20, file),
            path: path.to_path_buf(),
            file_len,
            pos: 0,
        };
        let magic = if file_len >= 4 {
            r.bytes(4, "the magic")?
        } else {
            let mut b = Vec::new();
            r.inner.read_to_end(&mut b).map_err(io_err)?;
            b
        };
        if magic.as_slice() != GGUF_MAGIC {
            return Err(GgufError::NotGguf {
                path: path.to_path_buf(),
                magic,
            });
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(r.corrupt(format!(
                "GGUF version {version} is not supported (versions 2 and 3 are)"
            )));
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        if n_tensors > 1 << 20 || n_kv > 1 << 20 {
            return Err(r.corrupt(format!(
                "the header claims {n_tensors} tensors and {n_kv} metadata keys"
            )));
        }
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string("a metadata key")?;
            let type_id = r.u32(&key)?;
            let value = r.value(type_id, &key, 0)?;
            metadata.insert(key, value);
        }
        let mut directory = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string("a tensor name")?;
            let n_dims = r.u32(&name)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(r.corrupt(format!("tensor `{name}` claims {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&name)? as usize);
            }
            dims.reverse(); // GGUF lists the innermost dimension first.
            let type_id = r.u32(&name)?;
            let offset = r.u64(&name)?;
            directory.push((name, dims, type_id, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Value::U32(a)) if *a > 0 => *a as u64,
            _ => 32,
        };
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let mut tensors = HashMap::new();
        for (name, dims, type_id, offset) in directory {
            let dtype = dtype_from_id(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
                name: name.clone(),
                dtype: ggml_type_name(type_id),
            })?;
            // Sizes and offsets come from the file: checked arithmetic, so a hostile header is
            // an error, not an overflow.
            let too_big = || {
                r.corrupt(format!(
                    "tensor `{name}` claims dimensions {dims:?} or offset {offset} beyond any file"
                ))
            };
            let elems = dims
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(too_big)?;
            let block = dtype.block_size();
            if !elems.is_multiple_of(block) {
                return Err(r.corrupt(format!(
                    "tensor `{name}` has {elems} elements, not a multiple of its block size {block}"
                )));
            }
            let n_bytes = (elems / block)
                .checked_mul(dtype.type_size())
                .ok_or_else(too_big)?;
            let start = data_start.checked_add(offset).ok_or_else(too_big)?;
            let end = start.checked_add(n_bytes as u64).ok_or_else(too_big)?;
            if end > file_len {
                return Err(r.corrupt(format!(
                    "tensor `{name}` needs bytes {start}..{end} but the file has only {file_len} bytes"
                )));
            }
            tensors.insert(
                name,
                TensorEntry {
                    dtype,
                    dims,
                    offset: start,
                    n_bytes,
                },
            );
        }
        Ok(Self {
            metadata,
            tensors,
            backing: Backing::File {
                path: path.to_path_buf(),
            },
        })
    }

    /// A source held in memory (synthetic models for tests and benchmarks).
    pub fn in_memory(metadata: HashMap<String, Value>, tensors: Vec<RawTensor>) -> Self {
        let mut dir = HashMap::new();
        let mut data = HashMap::new();
        for t in tensors {
            dir.insert(
                t.name.clone(),
                TensorEntry {
                    dtype: t.dtype,
                    dims: t.dims,
                    offset: 0,
                    n_bytes: t.data.len(),
                },
            );
            data.insert(t.name, t.data);
        }
        Self {
            metadata,
            tensors: dir,
            backing: Backing::Memory(data),
        }
    }

    pub fn path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::File { path } => Some(path),
            Backing::Memory(_) => None,
        }
    }

    /// Reads (or, for in-memory sources, takes) one tensor's bytes.
    pub fn take_tensor(&mut self, name: &str) -> Result<RawTensor> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?
            .clone();
        let data = match &mut self.backing {
            Backing::File { path } => {
                let io_err = |e| GgufError::Io {
                    path: path.clone(),
                    source: e,
                };
                let mut f = File::open(&*path).map_err(io_err)?;
                f.seek(SeekFrom::Start(entry.offset)).map_err(io_err)?;
                let mut buf = AlignedBytes::zeroed(entry.n_bytes);
                f.read_exact(buf.as_mut_slice())
                    .map_err(|e| GgufError::Corrupt {
                        path: path.clone(),
                        detail: format!("tensor `{name}` cannot be read: {e}"),
                    })?;
                buf
            }
            Backing::Memory(map) => map
                .remove(name)
                .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?,
        };
        Ok(RawTensor {
            name: name.to_string(),
            dtype: entry.dtype,
            dims: entry.dims,
            data,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn require(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    pub fn string(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            other => Err(bad_key(key, format!("expected a string, found {other:?}"))),
        }
    }

    pub fn opt_string(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        value_as_u64(self.require(key)?)
            .map(|v| v as usize)
            .ok_or_else(|| bad_key(key, "expected a non-negative integer"))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => value_as_u64(v)
                .map(|v| Some(v as usize))
                .ok_or_else(|| bad_key(key, "expected a non-negative integer")),
        }
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        value_as_f64(self.require(key)?)
            .map(|v| v as f32)
            .ok_or_else(|| bad_key(key, "expected a number"))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => value_as_f64(v)
                .map(|v| Some(v as f32))
                .ok_or_else(|| bad_key(key, "expected a number")),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        match self.metadata.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }
}

fn bad_key(key: &str, detail: impl Into<String>) -> GgufError {
    GgufError::bad_key(key, detail)
}

pub fn value_as_u64(v: &Value) -> Option<u64> {
    Some(match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I8(x) if *x >= 0 => *x as u64,
        Value::I16(x) if *x >= 0 => *x as u64,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        _ => return None,
    })
}

pub fn value_as_f64(v: &Value) -> Option<f64> {
    Some(match v {
        Value::F32(x) => *x as f64,
        Value::F64(x) => *x,
        other => value_as_u64(other)? as f64,
    })
}

/// A short, human-readable rendering of a metadata value (long arrays summarised).
pub fn summarize_value(v: &Value) -> String {
    match v {
        Value::Array(items) if items.len() > 8 => format!("[array of {} items]", items.len()),
        Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(summarize_value).collect();
            format!("[{}]", inner.join(", "))
        }
        Value::String(s) if s.chars().count() > 120 => {
            let head: String = s.chars().take(117).collect();
            format!("{head:?}…")
        }
        Value::String(s) => format!("{s:?}"),
        Value::Bool(b) => b.to_string(),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        other => value_as_u64(other)
            .map(|x| x.to_string())
            .unwrap_or_else(|| format!("{other:?}")),
    }
}
