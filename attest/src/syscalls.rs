//! Raw system-call instructions in machine code, found by code small enough for the host.
//!
//! A full x86-64 decoder (iced-x86) would add 127 KB to the host, past its size budget. Finding
//! `syscall`, `sysenter` and `int 0x80` at instruction boundaries, rather than as bytes inside
//! other instructions, needs only where each instruction ends. So this module walks x86-64
//! code linearly from the start of each executable section with an instruction-length decoder:
//! prefixes, REX, VEX, EVEX, XOP, the one-, two- and three-byte opcode maps, ModRM/SIB/
//! displacement and immediates. `u-runner` (under `--strict`) and `u-attest inspect` both use
//! it, so they agree. `tests/syscalls.rs` checks it against iced-x86: the same instruction
//! boundaries and system calls over every component the workspace builds and the system's C
//! library. (Over data tables embedded in code, where neither decoder meets real instructions,
//! the two can measure invalid encodings differently.) On aarch64 every instruction is one
//! 4-byte word, and `svc` is matched directly.

/// The longest x86 instruction.
const MAX_LEN: usize = 15;

/// What one decoded x86-64 instruction is to the scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    /// Its length in bytes (at least 1).
    pub len: usize,
    /// Whether it enters the kernel directly: `syscall`, `sysenter` or `int 0x80`.
    pub system_call: bool,
}

/// Counts the raw system-call instructions in x86-64 `code`, decoded from its first byte.
pub fn count_x86_64(code: &[u8]) -> usize {
    let mut at = 0;
    let mut count = 0;
    while at < code.len() {
        let d = decode_x86_64(&code[at..]);
        count += usize::from(d.system_call);
        at += d.len;
    }
    count
}

/// Counts the `svc` instructions in aarch64 `code` (4-byte little-endian words).
pub fn count_aarch64(code: &[u8]) -> usize {
    code.chunks_exact(4)
        .filter(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) & 0xFFE0_001F == 0xD400_0001)
        .count()
}

/// How an opcode continues after its opcode byte(s).
#[derive(Clone, Copy)]
enum Operands {
    /// Nothing more.
    None,
    /// A ModRM byte (with SIB and displacement as it says).
    ModRm,
    /// A ModRM byte, then an immediate of this many bytes.
    ModRmImm(usize),
    /// An immediate of this many bytes, no ModRM.
    Imm(usize),
    /// A 16- or 32-bit immediate (by the operand-size prefix), with ModRM or not.
    ImmZ { modrm: bool },
    /// Not an instruction in 64-bit mode: it ends one byte after its opcode, as iced-x86
    /// measures an invalid instruction (so both scans stay in step over data in code).
    Invalid,
}

/// Decodes the length of the instruction at the start of `code`, measured as iced-x86 measures
/// it: an instruction cut off by the end of `code` takes what is left (at most 15 bytes), one
/// longer than 15 bytes counts 15, and an invalid one ends one byte after its opcode.
pub fn decode_x86_64(code: &[u8]) -> Decoded {
    decode(code).unwrap_or(Decoded {
        len: code.len().clamp(1, MAX_LEN),
        system_call: false,
    })
}

/// [`decode_x86_64`], `None` when `code` ends inside the instruction.
fn decode(code: &[u8]) -> Option<Decoded> {
    let byte = |i: usize| code.get(i).copied();
    let too_long = Decoded {
        len: MAX_LEN,
        system_call: false,
    };
    let mut i = 0;
    let (mut opsize16, mut addr32, mut rex_w) = (false, false, false);
    // Whether a 66/F2/F3/F0 or REX prefix came before the opcode (VEX and EVEX forbid them).
    let mut after_prefix = false;
    loop {
        match byte(i)? {
            0x66 => {
                opsize16 = true;
                after_prefix = true;
            }
            0x67 => addr32 = true,
            0xF0 | 0xF2 | 0xF3 => after_prefix = true,
            0x2E | 0x36 | 0x3E | 0x26 | 0x64 | 0x65 => {}
            // REX counts only right before the opcode: a later prefix or REX replaces it.
            rex @ 0x40..=0x4F => {
                rex_w = rex & 0x08 != 0;
                after_prefix = true;
                i += 1;
                if i >= MAX_LEN {
                    return Some(too_long);
                }
                continue;
            }
            _ => break,
        }
        rex_w = false;
        i += 1;
        if i >= MAX_LEN {
            return Some(too_long);
        }
    }
    let op = byte(i)?;
    i += 1;
    let (operands, system_call) = match op {
        0x0F => {
            let op2 = byte(i)?;
            i += 1;
            match op2 {
                0x38 => {
                    i += 1;
                    (Operands::ModRm, false)
                }
                0x3A => {
                    i += 1;
                    (Operands::ModRmImm(1), false)
                }
                0x0F => (Operands::ModRmImm(1), false),
                _ => (two_byte(op2), op2 == 0x05 || op2 == 0x34),
            }
        }
        0x8F if byte(i)? & 0x1F >= 8 => {
            // AMD's XOP: a three-byte prefix like VEX's, maps 8 (imm8), 9, and A (imm32, only
            // BEXTR and the LWP group).
            let (map, pp) = (byte(i)? & 0x1F, byte(i + 1)? & 0x03);
            i += 2;
            if !(8..=0xA).contains(&map) {
                (Operands::Invalid, false)
            } else {
                let opcode = byte(i)?;
                i += 1;
                let operands = match map {
                    _ if pp != 0 => Operands::Invalid,
                    8 => Operands::ModRmImm(1),
                    9 => Operands::ModRm,
                    _ if matches!(opcode, 0x10 | 0x12) => Operands::ModRmImm(4),
                    _ => Operands::Invalid,
                };
                (operands, false)
            }
        }
        0xFE | 0xFF if (byte(i)? >> 3) & 7 >= if op == 0xFE { 2 } else { 7 } => {
            (Operands::Invalid, false)
        }
        0xC6 | 0xC7 if byte(i)? & 0x38 != 0 && byte(i)? != 0xF8 => (Operands::Invalid, false),
        0xC4 | 0xC5 | 0x62 => {
            // VEX (two or three bytes) or EVEX (four): the map and opcode follow. A map that
            // does not exist ends the instruction there; an EVEX prefix with its fixed bits
            // wrong, or any of them after a 66/F2/F3/F0 or REX prefix, is invalid after the
            // opcode (and its ModRM, when the opcode takes one).
            let (map, payload, valid) = match op {
                0xC5 => (1, 1, true),
                0xC4 => {
                    let map = byte(i)? & 0x1F;
                    (map, 2, (1..=3).contains(&map))
                }
                _ => {
                    let (p0, p1) = (byte(i)?, byte(i + 1)?);
                    let map = p0 & 0x07;
                    let fixed = p0 & 0x0C == 0 && p1 & 0x04 != 0;
                    (map, 3, fixed && matches!(map, 1 | 2 | 3 | 5 | 6))
                }
            };
            i += payload;
            if op == 0xC4 && !valid {
                return Some(Decoded {
                    len: i + 1,
                    system_call: false,
                });
            }
            let opcode = byte(i)?;
            i += 1;
            let operands = vex(map, opcode);
            if valid && !after_prefix {
                (operands, false)
            } else {
                let modrm = !matches!(operands, Operands::None);
                return (i + usize::from(modrm) <= code.len()).then_some(Decoded {
                    len: i + usize::from(modrm),
                    system_call: false,
                });
            }
        }
        // x87 memory forms that do not exist.
        0xD9 | 0xDB | 0xDD
            if byte(i)? >> 6 != 3
                && matches!(
                    (op, (byte(i)? >> 3) & 7),
                    (0xD9, 1) | (0xDB, 4 | 6) | (0xDD, 5)
                ) =>
        {
            (Operands::Invalid, false)
        }
        0xCD => (Operands::Imm(1), byte(i)? == 0x80),
        0xA0..=0xA3 => (Operands::Imm(if addr32 { 4 } else { 8 }), false),
        0xB8..=0xBF if rex_w => (Operands::Imm(8), false),
        0xF6 | 0xF7 => {
            // TEST r/m, imm is /0 and /1; the rest of the group has no immediate.
            let reg = (byte(i)? >> 3) & 7;
            match (op, reg) {
                (0xF6, 0 | 1) => (Operands::ModRmImm(1), false),
                (0xF7, 0 | 1) => (Operands::ImmZ { modrm: true }, false),
                _ => (Operands::ModRm, false),
            }
        }
        _ => (one_byte(op), false),
    };
    let immz = if opsize16 { 2 } else { 4 };
    let (modrm, imm) = match operands {
        Operands::None => (false, 0),
        Operands::ModRm => (true, 0),
        Operands::ModRmImm(n) => (true, n),
        Operands::Imm(n) => (false, n),
        Operands::ImmZ { modrm } => (modrm, immz),
        Operands::Invalid => {
            return (i < code.len()).then_some(Decoded {
                len: i + 1,
                system_call: false,
            });
        }
    };
    if modrm {
        let m = byte(i)?;
        i += 1;
        let (mode, rm) = (m >> 6, m & 7);
        if mode != 3 {
            if rm == 4 {
                let sib = byte(i)?;
                i += 1;
                if mode == 0 && sib & 7 == 5 {
                    i += 4;
                }
            }
            i += match (mode, rm) {
                (0, 5) => 4,
                (1, _) => 1,
                (2, _) => 4,
                _ => 0,
            };
        }
    }
    i += imm;
    if i > code.len() {
        return None;
    }
    Some(if i > MAX_LEN {
        too_long
    } else {
        Decoded {
            len: i,
            system_call,
        }
    })
}

/// The one-byte opcode map in 64-bit mode (prefixes, REX, VEX/EVEX, `0F`, `CD`, moffs,
/// `mov r64, imm64` and the `F6`/`F7` group are decoded before this is asked).
fn one_byte(op: u8) -> Operands {
    use Operands::*;
    match op {
        // ALU r/m forms, and the same with immediates into AL / eAX.
        0x06 | 0x07 | 0x0E | 0x16 | 0x17 | 0x1E | 0x1F | 0x27 | 0x2F | 0x37 | 0x3F => Invalid,
        0x00..=0x3F => match op & 7 {
            0..=3 => ModRm,
            4 => Imm(1),
            5 => ImmZ { modrm: false },
            _ => None,
        },
        0x60 | 0x61 | 0x82 | 0x9A | 0xCE | 0xD6 | 0xEA => Invalid,
        0x63 | 0x84..=0x8F => ModRm,
        0x68 => ImmZ { modrm: false },
        0x69 => ImmZ { modrm: true },
        0x6A | 0x70..=0x7F | 0xA8 | 0xB0..=0xB7 | 0xCD | 0xD4 | 0xD5 | 0xE0..=0xE7 | 0xEB => Imm(1),
        0x6B | 0x80 | 0x83 | 0xC0 | 0xC1 | 0xC6 => ModRmImm(1),
        0x81 | 0xC7 => ImmZ { modrm: true },
        0xA9 | 0xB8..=0xBF => ImmZ { modrm: false },
        0xC2 | 0xCA => Imm(2),
        0xC8 => Imm(3),
        0xD0..=0xD3 | 0xD8..=0xDF | 0xFE | 0xFF => ModRm,
        0xE8 | 0xE9 => Imm(4),
        _ => None,
    }
}

/// The two-byte opcode map (`0F xx`, without VEX).
fn two_byte(op: u8) -> Operands {
    use Operands::*;
    match op {
        0x04 | 0x0A | 0x0C | 0x24..=0x27 | 0x36 | 0x39 | 0x3B..=0x3F | 0x7A | 0x7B => Invalid,
        0x70..=0x73 | 0xA4 | 0xAC | 0xBA | 0xC2 | 0xC4..=0xC6 => ModRmImm(1),
        0x80..=0x8F => Imm(4),
        0x05..=0x09
        | 0x0B
        | 0x0E
        | 0x30..=0x37
        | 0x77
        | 0xA0..=0xA2
        | 0xA8..=0xAA
        | 0xC8..=0xCF => None,
        _ => ModRm,
    }
}

/// A VEX or EVEX instruction's operands by its map (1: `0F`, 2: `0F38`, 3: `0F3A`, 5 and 6:
/// the FP16 maps) and opcode.
fn vex(map: u8, op: u8) -> Operands {
    use Operands::*;
    match (map, op) {
        (1, 0x77) => None,
        (1, 0x70..=0x73 | 0xC2 | 0xC4..=0xC6) | (3, _) => ModRmImm(1),
        _ => ModRm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn len(bytes: &[u8]) -> usize {
        decode_x86_64(bytes).len
    }

    #[test]
    fn lengths_of_hand_picked_instructions() {
        assert_eq!(len(&[0x0F, 0x05]), 2); // syscall
        assert!(decode_x86_64(&[0x0F, 0x05]).system_call);
        assert!(decode_x86_64(&[0x0F, 0x34]).system_call); // sysenter
        assert!(decode_x86_64(&[0xCD, 0x80]).system_call); // int 0x80
        assert!(!decode_x86_64(&[0xCD, 0x03]).system_call);
        assert_eq!(len(&[0x48, 0xB8, 1, 2, 3, 4, 5, 6, 7, 8]), 10); // mov rax, imm64
        assert_eq!(len(&[0xB8, 1, 2, 3, 4]), 5); // mov eax, imm32
        assert_eq!(len(&[0x66, 0xB8, 1, 2]), 4); // mov ax, imm16
        assert_eq!(len(&[0x48, 0x8B, 0x05, 0, 0, 0, 0]), 7); // mov rax, [rip+d32]
        assert_eq!(len(&[0x8B, 0x44, 0x24, 0x08]), 4); // mov eax, [rsp+8]
        assert_eq!(len(&[0x8B, 0x04, 0x25, 0, 0, 0, 0]), 7); // mov eax, [d32] (SIB, no base)
        assert_eq!(len(&[0xF7, 0xC0, 1, 0, 0, 0]), 6); // test eax, imm32
        assert_eq!(len(&[0xF7, 0xD8]), 2); // neg eax
        assert_eq!(len(&[0xC5, 0xFC, 0x77]), 3); // vzeroupper... as VEX 0F 77
        assert_eq!(len(&[0xC5, 0xF8, 0x77]), 3);
        assert_eq!(len(&[0xC4, 0xE3, 0x7D, 0x18, 0xC1, 0x01]), 6); // vinsertf128 ymm0, ymm0, xmm1, 1
        assert_eq!(len(&[0x62, 0xF1, 0x7C, 0x48, 0x58, 0x44, 0x24, 0x01]), 8); // vaddps zmm0, zmm0, [rsp+64]
        assert_eq!(len(&[0x66, 0x0F, 0x3A, 0x0F, 0xC1, 0x08]), 6); // palignr xmm0, xmm1, 8
        assert_eq!(len(&[0x0F, 0x1F, 0x44, 0x00, 0x00]), 5); // nop dword [rax+rax]
        assert_eq!(len(&[0xF3, 0x0F, 0x1E, 0xFA]), 4); // endbr64
        assert_eq!(len(&[0xE8, 0, 0, 0, 0]), 5); // call rel32
        assert_eq!(len(&[0x0F, 0x84, 0, 0, 0, 0]), 6); // je rel32
        // Cut off by the end: what is left. Invalid: one byte past the opcode.
        assert_eq!(len(&[0x48, 0xB8, 1]), 3);
        assert_eq!(len(&[0x06, 0x90, 0x90]), 2);
        assert_eq!(len(&[0xF0; 20]), 15);
        assert_eq!(count_x86_64(&[0x90, 0x0F, 0x05, 0xB8, 0x0F, 0x05, 0, 0]), 1);
        assert_eq!(len(&[0x47, 0x40, 0xA3, 1, 2, 3, 4, 5, 6, 7, 8]), 11); // the last REX counts
        assert_eq!(len(&[0x48, 0x66, 0xB8, 1, 2]), 5); // a REX before a prefix is ignored
        assert_eq!(count_aarch64(&0xD400_0001u32.to_le_bytes()), 1);
    }
}
