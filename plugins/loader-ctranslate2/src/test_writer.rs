//! Writes `model.bin` files the way CTranslate2's `ModelSpec._serialize` does, for tests only
//! (unit tests include it as a module, integration tests by path).

#![allow(dead_code)]

/// Appends a CTranslate2 string: `u16` length counting the NUL, the bytes, the NUL.
pub fn string(out: &mut Vec<u8>, s: &str) {
    raw_string(out, s.as_bytes());
}

/// [`string`] of arbitrary bytes.
pub fn raw_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend((s.len() as u16 + 1).to_le_bytes());
    out.extend(s);
    out.push(0);
}

/// One variable to write.
pub struct Var {
    /// Name bytes (not necessarily UTF-8).
    pub name: Vec<u8>,
    /// Dimensions.
    pub dims: Vec<u32>,
    /// CTranslate2 dtype id.
    pub dtype_id: u8,
    /// Declared byte count (defaults to `data.len()`).
    pub nbytes: u32,
    /// The bytes written.
    pub data: Vec<u8>,
}

/// A `model.bin` under construction.
pub struct ModelBinWriter {
    /// Binary version (6 unless changed).
    pub version: u32,
    /// Spec name.
    pub spec: String,
    /// Spec revision.
    pub revision: u32,
    /// Variables, in order.
    pub vars: Vec<Var>,
    /// (alias, target) pairs.
    pub aliases: Vec<(String, String)>,
}

impl ModelBinWriter {
    /// An empty model of `spec`, binary version 6.
    pub fn new(spec: &str, revision: u32) -> Self {
        Self {
            version: 6,
            spec: spec.into(),
            revision,
            vars: Vec::new(),
            aliases: Vec::new(),
        }
    }

    /// Sets the binary version.
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Adds a variable; `data` is written as is and counted as its byte count.
    pub fn var(self, name: &str, dims: &[u32], dtype_id: u8, data: &[u8]) -> Self {
        self.var_raw_name(name.as_bytes(), dims, dtype_id, data)
    }

    /// [`Self::var`] with a name of arbitrary bytes.
    pub fn var_raw_name(mut self, name: &[u8], dims: &[u32], dtype_id: u8, data: &[u8]) -> Self {
        self.vars.push(Var {
            name: name.to_vec(),
            dims: dims.to_vec(),
            dtype_id,
            nbytes: data.len() as u32,
            data: data.to_vec(),
        });
        self
    }

    /// Overrides the declared byte count of the last variable.
    pub fn raw_nbytes(mut self, nbytes: u32) -> Self {
        if let Some(v) = self.vars.last_mut() {
            v.nbytes = nbytes;
        }
        self
    }

    /// Adds an alias.
    pub fn alias(mut self, alias: &str, target: &str) -> Self {
        self.aliases.push((alias.into(), target.into()));
        self
    }

    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = self.version.to_le_bytes().to_vec();
        string(&mut out, &self.spec);
        out.extend(self.revision.to_le_bytes());
        out.extend((self.vars.len() as u32).to_le_bytes());
        for v in &self.vars {
            raw_string(&mut out, &v.name);
            out.push(v.dims.len() as u8);
            for d in &v.dims {
                out.extend(d.to_le_bytes());
            }
            out.push(v.dtype_id);
            out.extend(v.nbytes.to_le_bytes());
            out.extend(&v.data);
        }
        out.extend((self.aliases.len() as u32).to_le_bytes());
        for (alias, target) in &self.aliases {
            string(&mut out, alias);
            string(&mut out, target);
        }
        out
    }
}
