//! Reading the parts of an ELF file that attestation needs.
//!
//! Only what is needed: where `.u.meta` sits in the file, the executable byte ranges, the
//! imported dynamic symbols, and the sanity facts the host insists on (no segment both writable
//! and executable, no executable stack, no text relocations).

use object::{
    Endian, Endianness, ReadRef, StringTable, elf,
    read::elf::{
        Dyn as _, FileHeader as _, ProgramHeader as _, SectionHeader as _, SectionTable, Sym as _,
    },
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
    pub code: Sections,
    /// Undefined dynamic symbols (what the file imports), without version suffixes.
    pub imports: BTreeSet<String>,
    /// Defined dynamic symbols (what the file exports).
    pub exports: BTreeSet<String>,
}

/// Parses `bytes` and locates everything attestation needs.
pub fn analyse(bytes: &[u8]) -> Result<ElfFacts, ElfError> {
    let file = Elf::parse(bytes)?;
    let e = file.endian;
    let machine = match file.header.e_machine(e) {
        elf::EM_X86_64 => Machine::X86_64,
        elf::EM_AARCH64 => Machine::Aarch64,
        other => return Err(ElfError::Machine(other.0)),
    };
    let e_type = file.header.e_type(e);
    if e_type != elf::ET_DYN && e_type != elf::ET_EXEC {
        return Err(ElfError::Parse(format!(
            "ELF type {} is neither a shared object nor an executable",
            e_type.0
        )));
    }
    let (meta, code) = section_ranges(&file, bytes)?;
    let meta = meta.ok_or(ElfError::NoMeta)?;
    let imports = file
        .dynsyms
        .iter()
        .filter(|s| !s.defined)
        .map(|s| s.name.split('@').next().unwrap_or(s.name).to_string())
        .filter(|n| !n.is_empty())
        .collect();
    let exports = file
        .dynsyms
        .iter()
        .filter(|s| s.defined)
        .map(|s| s.name.to_string())
        .collect();
    Ok(ElfFacts {
        exports,
        meta,
        machine,
        shared_object: e_type == elf::ET_DYN,
        code,
        imports,
    })
}

/// The executable sections of any 64-bit ELF file, by name and file range (for files that are
/// not U components, such as the system's C library in the tests).
pub fn executable_sections(bytes: &[u8]) -> Result<Sections, ElfError> {
    let file = Elf::parse(bytes)?;
    Ok(section_ranges(&file, bytes)?.1)
}

/// Sections by name and file range.
pub type Sections = Vec<(String, Range<usize>)>;

/// `.u.meta`'s range, if there is one, and the executable sections' names and ranges.
fn section_ranges(
    file: &Elf<'_>,
    bytes: &[u8],
) -> Result<(Option<Range<usize>>, Sections), ElfError> {
    let e = file.endian;
    let mut meta = None;
    let mut code = Vec::new();
    for sh in file.sections.iter() {
        let name = file
            .sections
            .section_name(e, sh)
            .ok()
            .and_then(|n| std::str::from_utf8(n).ok())
            .unwrap_or("");
        if sh.sh_type(e) == elf::SHT_NOBITS {
            continue;
        }
        let size = sh.sh_size(e);
        let range = file_range(sh.sh_offset(e), size, bytes.len()).ok_or_else(|| {
            ElfError::OutOfBounds {
                section: if name.is_empty() {
                    "unnamed".into()
                } else {
                    name.into()
                },
            }
        })?;
        if name == SECTION_NAME {
            if size != META_SIZE as u64 {
                return Err(ElfError::MetaSize { found: size });
            }
            meta = Some(range.clone());
        }
        if sh.sh_flags(e).0 & elf::SHF_EXECINSTR.0 != 0 {
            code.push((name.to_string(), range));
        }
    }
    Ok((meta, code))
}

/// Checks the facts the host insists on before mapping a file: no W+X segment, no executable
/// stack, no text relocations.
pub fn check_sanity(bytes: &[u8]) -> Result<(), ElfError> {
    let file = Elf::parse(bytes)?;
    let e = file.endian;
    for (index, ph) in file.segments.iter().enumerate() {
        let (p_type, flags) = (ph.p_type(e), ph.p_flags(e).0);
        let (w, x) = (flags & elf::PF_W.0 != 0, flags & elf::PF_X.0 != 0);
        if p_type == elf::PT_LOAD && w && x {
            return Err(ElfError::WritableExecutable { index });
        }
        if p_type == elf::PT_GNU_STACK && x {
            return Err(ElfError::ExecutableStack);
        }
    }
    for d in file.dynamic {
        let tag = d.d_tag(e);
        if tag == elf::DT_TEXTREL || (tag == elf::DT_FLAGS && d.d_val(e) & elf::DF_TEXTREL.0 != 0) {
            return Err(ElfError::TextRelocations);
        }
    }
    Ok(())
}

fn file_range(offset: u64, size: u64, file_len: usize) -> Option<Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(usize::try_from(size).ok()?)?;
    (end <= file_len).then_some(start..end)
}

type Header = elf::FileHeader64<Endianness>;

/// A dynamic symbol: its name (with any version suffix) and whether the file defines it.
struct DynSym<'a> {
    name: &'a str,
    defined: bool,
}

/// The structure of a 64-bit ELF file, as far as attestation reads it.
///
/// The dynamic symbols are read the way the dynamic loader finds them: through the
/// `PT_DYNAMIC` segment (`DT_SYMTAB`, `DT_STRTAB`), not the section headers (which the loader
/// never reads, so a `.dynsym` section could say anything). Their count comes from the hash
/// table (`DT_GNU_HASH`, else `DT_HASH`), raised to cover every symbol a dynamic relocation
/// names.
struct Elf<'a> {
    endian: Endianness,
    header: &'a Header,
    segments: &'a [elf::ProgramHeader64<Endianness>],
    sections: SectionTable<'a, Header, &'a [u8]>,
    /// The first `PT_DYNAMIC` segment's entries, up to and including `DT_NULL`.
    dynamic: &'a [elf::Dyn64<Endianness>],
    dynsyms: Vec<DynSym<'a>>,
}

fn malformed(what: impl std::fmt::Display) -> ElfError {
    ElfError::Parse(what.to_string())
}

impl<'a> Elf<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Self, ElfError> {
        if bytes.get(..4) == Some(&elf::ELFMAG[..]) && bytes.get(4) == Some(&elf::ELFCLASS32.0) {
            return Err(malformed(
                "32-bit ELF (ELFCLASS32); components are 64-bit x86_64 or aarch64",
            ));
        }
        let header = Header::parse(bytes).map_err(malformed)?;
        let endian = header.endian().map_err(malformed)?;
        let segments = header.program_headers(endian, bytes).map_err(malformed)?;
        let sections = header.sections(endian, bytes).map_err(malformed)?;
        let mut dynamic: &[elf::Dyn64<Endianness>] = &[];
        if let Some(ph) = segments
            .iter()
            .find(|p| p.p_type(endian) == elf::PT_DYNAMIC)
        {
            let all = ph.dynamic(endian, bytes).map_err(malformed)?.unwrap_or(&[]);
            let end = all
                .iter()
                .position(|d| d.d_tag(endian) == elf::DT_NULL)
                .map_or(all.len(), |i| i + 1);
            dynamic = &all[..end];
        }
        let mut parsed = Elf {
            endian,
            header,
            segments,
            sections,
            dynamic,
            dynsyms: Vec::new(),
        };
        parsed.dynsyms = parsed.dynamic_symbols(bytes)?;
        Ok(parsed)
    }

    /// The file offset of virtual address `address`, through the `PT_LOAD` segment that maps it.
    fn offset_of(&self, address: u64) -> Option<u64> {
        let e = self.endian;
        self.segments.iter().find_map(|ph| {
            let delta = address.checked_sub(ph.p_vaddr(e))?;
            (ph.p_type(e) == elf::PT_LOAD && delta < ph.p_memsz(e))
                .then(|| ph.p_offset(e).checked_add(delta))?
        })
    }

    /// The file offset that dynamic entry `tag`'s address maps to, if the entry is present.
    fn mapped(&self, tag: elf::DynamicTag, address: Option<u64>) -> Result<Option<u64>, ElfError> {
        address
            .map(|a| {
                self.offset_of(a).ok_or_else(|| {
                    malformed(format!(
                        "dynamic entry {:#x} points at address {a:#x}, which no loadable segment maps",
                        tag.0
                    ))
                })
            })
            .transpose()
    }

    fn dynamic_symbols(&self, bytes: &'a [u8]) -> Result<Vec<DynSym<'a>>, ElfError> {
        let e = self.endian;
        if self.dynamic.is_empty() {
            return Ok(Vec::new());
        }
        // Later entries override earlier ones, as the loader reads them.
        let value = |tag: elf::DynamicTag| {
            self.dynamic
                .iter()
                .rev()
                .find(|d| d.d_tag(e) == tag)
                .map(|d| d.d_val(e))
        };
        let strings = match self.mapped(elf::DT_STRTAB, value(elf::DT_STRTAB))? {
            Some(start) => {
                let end = start
                    .checked_add(value(elf::DT_STRSZ).unwrap_or(0))
                    .filter(|&end| end <= bytes.len() as u64)
                    .ok_or_else(|| {
                        malformed("dynamic string table (DT_STRSZ) past the end of the file")
                    })?;
                StringTable::new(bytes, start, end)
            }
            None => StringTable::default(),
        };
        // A hash table that no segment maps counts as absent.
        let mut count = if let Some(at) = value(elf::DT_GNU_HASH).and_then(|a| self.offset_of(a)) {
            gnu_hash_len(bytes, at, e)?
        } else if let Some(at) = value(elf::DT_HASH).and_then(|a| self.offset_of(a)) {
            u64::from(word(bytes, at.saturating_add(4), e)?)
        } else {
            0
        };
        let is_mips64el = self.header.is_mips64el(e);
        let mut max_sym = 0u32;
        let plt_is_rela = value(elf::DT_PLTREL) == Some(elf::DT_RELA.0 as u64);
        for (table, size, rela) in [
            (elf::DT_RELA, elf::DT_RELASZ, true),
            (elf::DT_REL, elf::DT_RELSZ, false),
            (elf::DT_JMPREL, elf::DT_PLTRELSZ, plt_is_rela),
        ] {
            let size = value(size).unwrap_or(0);
            if size == 0 {
                continue;
            }
            let at = self.mapped(table, value(table))?.ok_or_else(|| {
                malformed(format!(
                    "dynamic entry {:#x} missing for its relocations",
                    table.0
                ))
            })?;
            let table_bytes = bytes
                .read_bytes_at(at, size)
                .map_err(|()| malformed("dynamic relocations past the end of the file"))?;
            let max = if rela {
                let n = table_bytes.len() / size_of::<elf::Rela64<Endianness>>();
                table_bytes
                    .read_slice_at::<elf::Rela64<Endianness>>(0, n)
                    .map_err(|()| malformed("invalid dynamic relocations"))?
                    .iter()
                    .map(|r| r.r_sym(e, is_mips64el))
                    .max()
            } else {
                let n = table_bytes.len() / size_of::<elf::Rel64<Endianness>>();
                table_bytes
                    .read_slice_at::<elf::Rel64<Endianness>>(0, n)
                    .map_err(|()| malformed("invalid dynamic relocations"))?
                    .iter()
                    .map(|r| r.r_sym(e))
                    .max()
            };
            max_sym = max_sym.max(max.unwrap_or(0));
        }
        if max_sym != 0 {
            count = count.max(u64::from(max_sym) + 1);
        }
        if count == 0 {
            return Ok(Vec::new());
        }
        let at = self
            .mapped(elf::DT_SYMTAB, value(elf::DT_SYMTAB))?
            .ok_or_else(|| malformed("dynamic symbols without a DT_SYMTAB entry"))?;
        let count = usize::try_from(count).map_err(malformed)?;
        let symbols = bytes
            .read_slice_at::<elf::Sym64<Endianness>>(at, count)
            .map_err(|()| malformed("dynamic symbol table past the end of the file"))?;
        let mut out = Vec::with_capacity(count);
        for s in symbols {
            let offset = s.st_name(e);
            if offset == 0 {
                continue;
            }
            let name = strings
                .get(offset)
                .ok()
                .and_then(|n| std::str::from_utf8(n).ok())
                .ok_or_else(|| malformed("dynamic symbol name outside the dynamic string table"))?;
            out.push(DynSym {
                name,
                defined: s.st_shndx(e) != elf::SHN_UNDEF,
            });
        }
        Ok(out)
    }
}

/// A 32-bit word of the file at `offset`.
fn word(bytes: &[u8], offset: u64, e: Endianness) -> Result<u32, ElfError> {
    let b = bytes
        .read_bytes_at(offset, 4)
        .map_err(|()| malformed("hash table past the end of the file"))?;
    Ok(e.read_u32([b[0], b[1], b[2], b[3]]))
}

/// The number of dynamic symbols a `DT_GNU_HASH` table at `offset` covers: one past the end of
/// the chain of the highest bucket.
fn gnu_hash_len(bytes: &[u8], offset: u64, e: Endianness) -> Result<u64, ElfError> {
    let buckets = u64::from(word(bytes, offset, e)?);
    let symbol_base = u64::from(word(bytes, offset.saturating_add(4), e)?);
    let bloom = u64::from(word(bytes, offset.saturating_add(8), e)?);
    if buckets == 0 || symbol_base == 0 || bloom == 0 {
        return Err(malformed(format!(
            "invalid DT_GNU_HASH: buckets {buckets}, symbol base {symbol_base}, bloom size {bloom}"
        )));
    }
    let past = || malformed("hash table past the end of the file");
    let buckets_at = offset.checked_add(16 + bloom * 8).ok_or_else(past)?;
    let mut last = 0;
    for i in 0..buckets {
        last = last.max(u64::from(word(bytes, buckets_at.saturating_add(i * 4), e)?));
    }
    if last < symbol_base {
        return Ok(0);
    }
    let mut at = buckets_at
        .checked_add((buckets + last - symbol_base) * 4)
        .ok_or_else(past)?;
    loop {
        let hash = word(bytes, at, e)?;
        last += 1;
        at = at.checked_add(4).ok_or_else(past)?;
        if hash & 1 != 0 {
            return Ok(last);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test binary: a 64-bit ELF executable of the build's machine, with no `.u.meta`.
    fn own_executable() -> Vec<u8> {
        std::fs::read(std::env::current_exe().unwrap()).unwrap()
    }

    #[test]
    fn reads_a_real_executable() {
        let bytes = own_executable();
        check_sanity(&bytes).unwrap();
        assert_eq!(analyse(&bytes).unwrap_err(), ElfError::NoMeta);
        let parsed = Elf::parse(&bytes).unwrap();
        assert!(
            parsed
                .dynsyms
                .iter()
                .any(|s| !s.defined && s.name.starts_with("malloc"))
        );
    }

    #[test]
    fn elf32_is_a_clear_parse_error() {
        let mut bytes = own_executable();
        bytes[4] = 1; // EI_CLASS = ELFCLASS32
        for result in [analyse(&bytes).map(|_| ()), check_sanity(&bytes)] {
            match result {
                Err(ElfError::Parse(m)) => assert!(m.contains("32-bit"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let bytes = own_executable();
        for len in [0, 3, 16, 63, 64, 65, 200, bytes.len() / 2, bytes.len() - 1] {
            assert!(matches!(
                analyse(&bytes[..len]),
                Err(ElfError::Parse(_) | ElfError::OutOfBounds { .. })
            ));
        }
        assert!(matches!(analyse(b"#!/bin/sh\n"), Err(ElfError::Parse(_))));
        // Every byte of the headers flipped in turn: an answer, never a panic.
        let mut copy = bytes.clone();
        for i in 0..copy.len().min(4096) {
            copy[i] ^= 0xff;
            let _ = analyse(&copy);
            let _ = check_sanity(&copy);
            copy[i] ^= 0xff;
        }
    }
}
