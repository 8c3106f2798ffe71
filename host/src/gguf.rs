//! GGUF files: parsing and validation of an untrusted model file.
//!
//! A GGUF file is a header, a table of typed metadata key/values, a table of tensor descriptors and
//! an aligned data section. Everything in it is treated as hostile: every count, length, offset,
//! size and type is checked against the bytes actually present before it is used, so a malformed
//! file yields a [`GgufError`] naming what was wrong, never a panic or an out-of-bounds read.
//!
//! ```no_run
//! let file = warden::gguf::Gguf::open("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use warden_kernels::quant::GgmlType;

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const MAX_DIMS: usize = 4;
const MAX_ARRAY_DEPTH: usize = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

/// What went wrong reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:#010x}, expected 0x46554747 (\"GGUF\")")]
    BadMagic {
        /// The magic found.
        found: u32,
    },
    /// A version other than 2 or 3.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The file ends before a structure it declares.
    #[error("file truncated: {what} needs {need} bytes at offset {offset}, file is {len} bytes")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where.
        offset: u64,
        /// Bytes needed.
        need: u64,
        /// File length.
        len: u64,
    },
    /// A count that cannot fit in the file.
    #[error("{what} count {count} is impossible for a {len}-byte file")]
    AbsurdCount {
        /// What was counted.
        what: String,
        /// The count declared.
        count: u64,
        /// File length.
        len: u64,
    },
    /// A metadata value type id that is not in the GGUF spec.
    #[error("metadata key {key:?}: unknown value type {ty}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id.
        ty: u32,
    },
    /// Arrays nested deeper than Warden accepts.
    #[error("metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    TooDeep {
        /// The key.
        key: String,
    },
    /// A string that is not UTF-8.
    #[error("{what}: string is not valid UTF-8")]
    BadUtf8 {
        /// Where.
        what: String,
    },
    /// The same key twice.
    #[error("duplicate {what} {name:?}")]
    Duplicate {
        /// "metadata key" or "tensor".
        what: &'static str,
        /// The name.
        name: String,
    },
    /// `general.alignment` that is zero or not a power of two.
    #[error("general.alignment {0} is not a power of two")]
    BadAlignment(u64),
    /// A tensor type Warden does not implement.
    #[error("tensor {name:?}: unsupported tensor type id {ty} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
    UnsupportedTensorType {
        /// The tensor.
        name: String,
        /// The type id.
        ty: u32,
    },
    /// Tensor shape that is empty, too many dimensions, zero-sized or overflowing.
    #[error("tensor {name:?}: invalid shape {dims:?}: {why}")]
    BadShape {
        /// The tensor.
        name: String,
        /// Its dims.
        dims: Vec<u64>,
        /// Why.
        why: String,
    },
    /// A tensor whose data lies outside the file or is misaligned.
    #[error("tensor {name:?}: data at offset {offset} of {size} bytes {why}")]
    BadTensorData {
        /// The tensor.
        name: String,
        /// Offset relative to the data section.
        offset: u64,
        /// Size in bytes.
        size: u64,
        /// Why.
        why: String,
    },
    /// A required metadata key is absent.
    #[error("missing metadata key {0:?}")]
    MissingKey(String),
    /// A metadata key with the wrong type.
    #[error("metadata key {key:?} should be {expected}, found {found}")]
    WrongType {
        /// The key.
        key: String,
        /// Expected type.
        expected: &'static str,
        /// Found type.
        found: &'static str,
    },
    /// A required tensor is absent.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// u8
    U8(u8),
    /// i8
    I8(i8),
    /// u16
    U16(u16),
    /// i16
    I16(i16),
    /// u32
    U32(u32),
    /// i32
    I32(i32),
    /// f32
    F32(f32),
    /// bool
    Bool(bool),
    /// UTF-8 string
    String(String),
    /// Array of values
    Array(Vec<Value>),
    /// u64
    U64(u64),
    /// i64
    I64(i64),
    /// f64
    F64(f64),
}

impl Value {
    /// The type's name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
}

/// One tensor's descriptor, validated against the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first (ggml order: `dims[0]` is the row length).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// A parsed, validated GGUF file whose tensor data stays memory-mapped.
pub struct Gguf {
    storage: Storage,
    /// GGUF version (2 or 3).
    pub version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn len(&self) -> u64 {
        self.b.len() as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let remaining = (self.b.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n,
                len: self.len(),
            });
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what() })
    }

    /// Rejects a declared count of items that each need at least `min_bytes` when the rest of the
    /// file cannot hold them, before anything is allocated for them.
    fn check_count(&self, count: u64, min_bytes: u64, what: &dyn Fn() -> String) -> Result<(), GgufError> {
        let remaining = (self.b.len() - self.pos) as u64;
        if count.saturating_mul(min_bytes) > remaining {
            return Err(GgufError::AbsurdCount {
                what: what(),
                count,
                len: self.len(),
            });
        }
        Ok(())
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        let w = || format!("metadata key {key:?}");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&w)?[0]),
            1 => Value::I8(self.array::<1>(&w)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&w)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&w)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&w)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&w)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&w)?)),
            7 => Value::Bool(self.array::<1>(&w)?[0] != 0),
            8 => Value::String(self.string(&w)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep { key: key.to_string() });
                }
                let ety = self.u32(&w)?;
                let n = self.u64(&w)?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    _ => {
                        return Err(GgufError::UnknownValueType {
                            key: key.to_string(),
                            ty: ety,
                        });
                    }
                };
                self.check_count(n, min, &|| format!("metadata key {key:?} array"))?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(&w)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&w)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&w)?)),
            _ => {
                return Err(GgufError::UnknownValueType {
                    key: key.to_string(),
                    ty,
                });
            }
        })
    }
}

impl Gguf {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process. Warden never writes model files
        // while serving them; a concurrent external truncation could fault, which is the documented
        // contract of serving from a memory-mapped file (llama.cpp makes the same one).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Parses a GGUF image held in memory (tests, and files received over the network).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, GgufError> {
        let b: &[u8] = match &storage {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        };
        let mut r = Reader { b, pos: 0 };
        let magic = r.u32(&|| "magic".into())?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32(&|| "version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64(&|| "tensor count".into())?;
        let n_kv = r.u64(&|| "metadata count".into())?;
        // A key/value needs at least 8 (key length) + 4 (type) + 1 bytes; a tensor descriptor at
        // least 8 + 4 + 8 + 4 + 8.
        r.check_count(n_kv, 13, &|| "metadata".into())?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&|| format!("metadata key #{i}"))?;
            let ty = r.u32(&|| format!("metadata key {key:?} type"))?;
            let v = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(GgufError::Duplicate {
                    what: "metadata key",
                    name: key,
                });
            }
        }
        r.check_count(n_tensors, 32, &|| "tensor".into())?;
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&|| format!("tensor #{i} name"))?;
            let w = || format!("tensor {name:?} descriptor");
            let nd = r.u32(&w)? as usize;
            if nd == 0 || nd > MAX_DIMS {
                return Err(GgufError::BadShape {
                    name,
                    dims: vec![],
                    why: format!("{nd} dimensions (1 to {MAX_DIMS} allowed)"),
                });
            }
            let mut dims = Vec::with_capacity(nd);
            for _ in 0..nd {
                dims.push(r.u64(&w)?);
            }
            let ty = r.u32(&w)?;
            let off = r.u64(&w)?;
            raw.push((name, dims, ty, off));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = b.len() as u64;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = BTreeMap::new();
        for (name, dims, ty_id, off) in raw {
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| GgufError::UnsupportedTensorType {
                name: name.clone(),
                ty: ty_id,
            })?;
            let bad = |why: String| GgufError::BadShape {
                name: name.clone(),
                dims: dims.clone(),
                why,
            };
            if dims.contains(&0) {
                return Err(bad("a dimension is zero".into()));
            }
            let elems = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad("element count overflows".into()))?;
            if !dims[0].is_multiple_of(ty.block_elems() as u64) {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {ty} block size {}",
                    dims[0],
                    ty.block_elems()
                )));
            }
            let size = ty.bytes_for(elems).ok_or_else(|| bad("byte size overflows".into()))?;
            let bad_data = |why: &str| GgufError::BadTensorData {
                name: name.clone(),
                offset: off,
                size,
                why: why.into(),
            };
            if !off.is_multiple_of(alignment) {
                return Err(bad_data(&format!("is not aligned to {alignment}")));
            }
            let abs = data_start.checked_add(off).ok_or_else(|| bad_data("overflows"))?;
            let end = abs.checked_add(size).ok_or_else(|| bad_data("overflows"))?;
            if end > file_len {
                return Err(bad_data(&format!(
                    "ends at {end}, past the end of the {file_len}-byte file"
                )));
            }
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Duplicate { what: "tensor", name });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset: abs as usize,
                size: size as usize,
            });
        }
        Ok(Self {
            storage,
            version,
            metadata,
            tensors,
            by_name,
        })
    }

    fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }

    /// All metadata.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required metadata value.
    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }

    /// A required string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(Self::wrong(key, "string", v)),
        }
    }

    /// A required non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, "unsigned integer", v))
    }

    /// A required number.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "number", v))
    }

    /// A required array.
    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => Err(Self::wrong(key, "array", v)),
        }
    }

    /// A required array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                v => Err(Self::wrong(key, "array of strings", v)),
            })
            .collect()
    }

    /// All tensor descriptors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor descriptor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A required tensor and its bytes.
    pub fn tensor_data(&self, name: &str) -> Result<(&TensorInfo, &[u8]), GgufError> {
        let t = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        // In bounds: checked against the file length in `parse`.
        Ok((t, &self.bytes()[t.offset..t.offset + t.size]))
    }
}

/// Builds GGUF images in memory, for tests of the loader and of code that reads models.
pub mod writer {
    use super::Value;

    /// A GGUF v3 image under construction.
    #[derive(Default)]
    pub struct GgufWriter {
        kv: Vec<(String, Value)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &Value) -> u32 {
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

    fn put_value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(s) => put_str(out, s),
            Value::Array(a) => {
                let ety = a.first().map(type_id).unwrap_or(4);
                out.extend_from_slice(&ety.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                for e in a {
                    put_value(out, e);
                }
            }
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }

    impl GgufWriter {
        /// Adds a metadata key.
        pub fn kv(mut self, key: &str, v: Value) -> Self {
            self.kv.push((key.to_string(), v));
            self
        }

        /// Adds a tensor with raw bytes of ggml type id `ty`.
        pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
            self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
            self
        }

        /// The file image.
        pub fn build(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(b"GGUF");
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
            for (k, v) in &self.kv {
                put_str(&mut out, k);
                out.extend_from_slice(&type_id(v).to_le_bytes());
                put_value(&mut out, v);
            }
            let mut off = 0u64;
            let mut offs = Vec::new();
            for (name, dims, ty, data) in &self.tensors {
                put_str(&mut out, name);
                out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&off.to_le_bytes());
                offs.push(off);
                off += (data.len() as u64).div_ceil(32) * 32;
            }
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
            for (_, _, _, data) in &self.tensors {
                out.extend_from_slice(data);
                while !out.len().is_multiple_of(32) {
                    out.push(0);
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::writer::GgufWriter;
    use super::*;

    fn sample() -> Vec<u8> {
        GgufWriter::default()
            .kv("general.architecture", Value::String("llama".into()))
            .kv("llama.block_count", Value::U32(1))
            .kv(
                "list",
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            )
            .tensor("w", &[32, 2], 0, vec![0u8; 256])
            .build()
    }

    #[test]
    fn parses_a_well_formed_image() {
        let g = Gguf::from_bytes(sample()).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get_u64("llama.block_count").unwrap(), 1);
        assert_eq!(g.get_str_array("list").unwrap(), vec!["a", "b"]);
        let (t, d) = g.tensor_data("w").unwrap();
        assert_eq!(t.dims, vec![32, 2]);
        assert_eq!(d.len(), 256);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = sample();
        for n in 0..full.len() - 1 {
            // Trailing padding after the last tensor is not needed, so only cuts into the data fail.
            let cut = full[..n].to_vec();
            if let Ok(g) = Gguf::from_bytes(cut) {
                panic!("truncated to {n} bytes parsed as {g:?}");
            }
        }
    }

    #[test]
    fn wrong_magic_is_named() {
        let mut b = sample();
        b[0] = b'X';
        let e = Gguf::from_bytes(b).unwrap_err().to_string();
        assert!(e.contains("not a GGUF file"), "{e}");
    }

    #[test]
    fn absurd_counts_are_rejected_before_allocation() {
        let mut b = sample();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
        let e = Gguf::from_bytes(b).unwrap_err().to_string();
        assert!(e.contains("impossible"), "{e}");
        let mut b = sample();
        b[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes()); // kv count
        assert!(matches!(Gguf::from_bytes(b), Err(GgufError::AbsurdCount { .. })));
        // A string length far past the end of the file.
        let mut b = sample();
        b[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(matches!(Gguf::from_bytes(b), Err(GgufError::Truncated { .. })));
    }

    #[test]
    fn bad_tensor_descriptors_are_rejected() {
        let img = |dims: &[u64], ty: u32, data: usize| {
            Gguf::from_bytes(GgufWriter::default().tensor("t", dims, ty, vec![0; data]).build())
        };
        assert!(matches!(
            img(&[32], 99, 128),
            Err(GgufError::UnsupportedTensorType { ty: 99, .. })
        ));
        assert!(matches!(img(&[0, 4], 0, 0), Err(GgufError::BadShape { .. })));
        assert!(matches!(img(&[33], 8, 64), Err(GgufError::BadShape { .. })));
        assert!(matches!(
            img(&[u64::MAX, u64::MAX], 0, 32),
            Err(GgufError::BadShape { .. })
        ));
        // Data declared past the end of the file.
        assert!(matches!(img(&[1 << 20], 0, 32), Err(GgufError::BadTensorData { .. })));
    }

    #[test]
    fn unknown_value_type_and_deep_nesting_are_errors() {
        let mut b = sample();
        // The first key's type id follows its 8-byte length and 20-byte name.
        let at = 24 + 8 + "general.architecture".len();
        b[at..at + 4].copy_from_slice(&77u32.to_le_bytes());
        assert!(matches!(
            Gguf::from_bytes(b),
            Err(GgufError::UnknownValueType { ty: 77, .. })
        ));
        let nested = (0..6).fold(Value::U8(1), |v, _| Value::Array(vec![v]));
        let b = GgufWriter::default().kv("deep", nested).build();
        assert!(matches!(Gguf::from_bytes(b), Err(GgufError::TooDeep { .. })));
    }
}
