//! Reading the parts of an ELF file that attestation needs.
//!
//! Only what is needed: where `.u.meta` sits in the file, the executable byte ranges, the
//! imported dynamic symbols, and the sanity facts the host insists on (no segment both writable
//! and executable, no executable stack, no text relocations).

use goblin::elf::{
    Elf,
    dynamic::{DF_TEXTREL, DT_FLAGS, DT_TEXTREL},
    header::{EM_AARCH64, EM_X86_64, ET_DYN, ET_EXEC},
    program_header::{PF_W, PF_X, PT_GNU_STACK, PT_LOAD},
    section_header::{SHF_EXECINSTR, SHT_NOBITS},
};
use std::{collections::BTreeSet, ops::Range};
use u_sdk::meta::{META_SIZE, SECTION_NAME};

/// Why a file was not accepted as an ELF component.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    /// Not parseable as ELF.
    #[error("not a valid ELF file (truncated or corrupt): {0}")]
    Parse(String),
    /// No `.u.meta` section.
    #[error("no {SECTION_NAME} section: not a U component (or the section was stripped)")]
    NoMeta,
    /// `.u.meta` has the wrong size.
    #[error("{SECTION_NAME} section is {found} bytes, expected {META_SIZE}")]
    MetaSize {
        /// Size found.
        found: u64,
    },
    /// A section points past the end of the file.
    #[error("{section} section extends past the end of the file (file truncated?)")]
    OutOfBounds {
        /// Which section.
        section: String,
    },
    /// A loadable segment is both writable and executable.
    #[error("ELF segment {index} is both writable and executable")]
    WritableExecutable {
        /// Program header index.
        index: usize,
    },
    /// The stack is marked executable.
    #[error("ELF requests an executable stack")]
    ExecutableStack,
    /// The file needs text relocations (code patched at load time).
    #[error("ELF has text relocations (DT_TEXTREL): code would be writable at load")]
    TextRelocations,
    /// An architecture this build does not handle.
    #[error("unsupported ELF machine {0}")]
    Machine(u16),
}

/// CPU architectures a component may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Machine {
    /// x86-64.
    X86_64,
    /// 64-bit Arm.
    Aarch64,
}

/// What attestation needs to know about an ELF file.
#[derive(Debug, Clone)]
pub struct ElfFacts {
    /// Byte range of the `.u.meta` section in the file.
    pub meta: Range<usize>,
    /// Target CPU.
    pub machine: Machine,
    /// Whether the file is a shared object (plugins) rather than an executable (`u-runner`).
    pub shared_object: bool,
    /// File ranges of executable sections, with their names.
    pub code: Vec<(String, Range<usize>)>,
    /// Undefined dynamic symbols (what the file imports), without version suffixes.
    pub imports: BTreeSet<String>,
    /// Defined dynamic symbols (what the file exports).
    pub exports: BTreeSet<String>,
}

/// Parses `bytes` and locates everything attestation needs.
pub fn analyse(bytes: &[u8]) -> Result<ElfFacts, ElfError> {
    let elf = Elf::parse(bytes).map_err(|e| ElfError::Parse(e.to_string()))?;
    let machine = match elf.header.e_machine {
        EM_X86_64 => Machine::X86_64,
        EM_AARCH64 => Machine::Aarch64,
        other => return Err(ElfError::Machine(other)),
    };
    if elf.header.e_type != ET_DYN && elf.header.e_type != ET_EXEC {
        return Err(ElfError::Parse(format!(
            "ELF type {} is neither a shared object nor an executable",
            elf.header.e_type
        )));
    }
    let mut meta = None;
    let mut code = Vec::new();
    for sh in &elf.section_headers {
        let name = elf.shdr_strtab.get_at(sh.sh_name).unwrap_or("");
        if sh.sh_type == SHT_NOBITS {
            continue;
        }
        let range = file_range(sh.sh_offset, sh.sh_size, bytes.len()).ok_or_else(|| {
            ElfError::OutOfBounds {
                section: if name.is_empty() {
                    "unnamed".into()
                } else {
                    name.into()
                },
            }
        })?;
        if name == SECTION_NAME {
            if sh.sh_size != META_SIZE as u64 {
                return Err(ElfError::MetaSize { found: sh.sh_size });
            }
            meta = Some(range.clone());
        }
        if sh.sh_flags & u64::from(SHF_EXECINSTR) != 0 {
            code.push((name.to_string(), range));
        }
    }
    let meta = meta.ok_or(ElfError::NoMeta)?;
    let imports = elf
        .dynsyms
        .iter()
        .filter(|s| s.st_shndx == 0 && s.st_name != 0)
        .filter_map(|s| elf.dynstrtab.get_at(s.st_name))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| !n.is_empty())
        .collect();
    let exports = elf
        .dynsyms
        .iter()
        .filter(|s| s.st_shndx != 0 && s.st_name != 0)
        .filter_map(|s| elf.dynstrtab.get_at(s.st_name))
        .map(str::to_string)
        .collect();
    Ok(ElfFacts {
        exports,
        meta,
        machine,
        shared_object: elf.header.e_type == ET_DYN,
        code,
        imports,
    })
}

/// Checks the facts the host insists on before mapping a file: no W+X segment, no executable
/// stack, no text relocations.
pub fn check_sanity(bytes: &[u8]) -> Result<(), ElfError> {
    let elf = Elf::parse(bytes).map_err(|e| ElfError::Parse(e.to_string()))?;
    for (index, ph) in elf.program_headers.iter().enumerate() {
        if ph.p_type == PT_LOAD && ph.p_flags & PF_W != 0 && ph.p_flags & PF_X != 0 {
            return Err(ElfError::WritableExecutable { index });
        }
        if ph.p_type == PT_GNU_STACK && ph.p_flags & PF_X != 0 {
            return Err(ElfError::ExecutableStack);
        }
    }
    if let Some(dynamic) = &elf.dynamic {
        for d in &dynamic.dyns {
            if d.d_tag == DT_TEXTREL || (d.d_tag == DT_FLAGS && d.d_val & DF_TEXTREL != 0) {
                return Err(ElfError::TextRelocations);
            }
        }
    }
    Ok(())
}

fn file_range(offset: u64, size: u64, file_len: usize) -> Option<Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(usize::try_from(size).ok()?)?;
    (end <= file_len).then_some(start..end)
}
