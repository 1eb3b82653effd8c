//! The GGUF (version 3) writer, kept apart from generation so that an existing source can be
//! written too, its tensors asked for one at a time.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{EngineError, Result};
use smolchat_gguf::{GgmlDType, Value};

pub(super) struct TensorInfo<'a> {
    pub(super) name: &'a str,
    pub(super) dtype: GgmlDType,
    pub(super) dims: &'a [usize],
    pub(super) n_bytes: usize,
}

const ALIGNMENT: usize = 32;

pub(super) fn io_error(path: &Path, e: std::io::Error) -> EngineError {
    EngineError::from(smolchat_gguf::GgufError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// GGUF type ids (the inverse of `gguf::dtype_from_id`).
fn dtype_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// Writes a value without its type tag. Errors (as `InvalidInput`) on an array mixing types,
/// which GGUF cannot express.
fn write_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => write_str(w, s),
        Value::Array(items) => {
            // An empty array still needs an element type; any will do.
            let elem = items.first().map(value_type_id).unwrap_or(4);
            if items.iter().any(|x| value_type_id(x) != elem) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a metadata array mixes value types",
                ));
            }
            w.write_all(&elem.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|x| write_value(w, x))
        }
    }
}

fn padding(pos: usize) -> usize {
    pos.next_multiple_of(ALIGNMENT) - pos
}

/// Writes a GGUF v3 file: header, metadata, tensor directory, then each tensor's bytes (asked of
/// `data` in directory order, so tensors can be streamed one at a time), 32-byte aligned.
pub(super) fn write_gguf_file(
    path: &Path,
    metadata: &[(&str, &Value)],
    tensors: &[TensorInfo],
    mut data: impl FnMut(usize, &mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    let file = File::create(path).map_err(|e| io_error(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut header: Vec<u8> = Vec::new();
    let io = |e| io_error(path, e);
    header.extend_from_slice(b"GGUF");
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        write_str(&mut header, k).map_err(io)?;
        header.extend_from_slice(&value_type_id(v).to_le_bytes());
        write_value(&mut header, v).map_err(|e| {
            EngineError::from(smolchat_gguf::GgufError::BadKey {
                key: k.to_string(),
                detail: e.to_string(),
            })
        })?;
    }
    let mut offset = 0usize;
    for t in tensors {
        write_str(&mut header, t.name).map_err(io)?;
        header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        // GGUF lists the innermost dimension first.
        for d in t.dims.iter().rev() {
            header.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        header.extend_from_slice(&dtype_id(t.dtype).to_le_bytes());
        header.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.n_bytes + padding(t.n_bytes);
    }
    header.resize(header.len() + padding(header.len()), 0);
    w.write_all(&header).map_err(io)?;
    let zeros = [0u8; ALIGNMENT];
    for (i, t) in tensors.iter().enumerate() {
        data(i, &mut w)?;
        w.write_all(&zeros[..padding(t.n_bytes)]).map_err(io)?;
    }
    w.flush().map_err(io)?;
    Ok(())
}
