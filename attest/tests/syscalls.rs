//! The host's instruction-length scan (`u_attest::syscalls`) against a full x86-64 decoder
//! (iced-x86): over every executable section of the components the workspace builds and of
//! the system's C library (which makes raw system calls), both find the same instruction
//! boundaries and the same `syscall`/`sysenter`/`int 0x80` instructions.

use iced_x86::{Decoder, DecoderOptions, Mnemonic};
use std::path::{Path, PathBuf};
use u_attest::{elf, syscalls};

/// Instruction starts and system calls as iced-x86 decodes `code`.
fn iced(code: &[u8]) -> (Vec<usize>, usize) {
    let mut starts = Vec::new();
    let mut calls = 0;
    let mut at = 0;
    for i in Decoder::new(64, code, DecoderOptions::NONE) {
        starts.push(at);
        at += i.len();
        let m = i.mnemonic();
        if matches!(m, Mnemonic::Syscall | Mnemonic::Sysenter)
            || (m == Mnemonic::Int && i.immediate8() == 0x80)
        {
            calls += 1;
        }
    }
    (starts, calls)
}

/// The same by the scan.
fn scan(code: &[u8]) -> (Vec<usize>, usize) {
    let mut starts = Vec::new();
    let mut calls = 0;
    let mut at = 0;
    while at < code.len() {
        starts.push(at);
        let d = syscalls::decode_x86_64(&code[at..]);
        calls += usize::from(d.system_call);
        at += d.len;
    }
    (starts, calls)
}

fn files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let plugins = root.join("target/plugins");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&plugins)
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask build` first)", plugins.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "so"))
        .collect();
    out.sort();
    out.push(root.join("target/release/u-runner"));
    for libc in [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
    ] {
        if Path::new(libc).exists() {
            out.push(libc.into());
            break;
        }
    }
    out
}

#[test]
fn the_scan_finds_what_a_full_decoder_finds() {
    let mut checked = 0;
    let mut libc_calls = 0;
    for path in files() {
        let bytes = std::fs::read(&path).unwrap();
        // The C library has no .u.meta: find its code sections by hand.
        let code: Vec<(String, std::ops::Range<usize>)> = match elf::analyse(&bytes) {
            Ok(f) if f.machine == elf::Machine::X86_64 => f.code,
            Ok(_) => continue,
            Err(_) => elf::executable_sections(&bytes).unwrap(),
        };
        for (name, range) in code {
            let section = &bytes[range];
            let (want, want_calls) = iced(section);
            let (got, got_calls) = scan(section);
            if let Some(i) = want.iter().zip(&got).position(|(a, b)| a != b) {
                let at = want[i.saturating_sub(1)];
                panic!(
                    "{} {name}: boundaries differ after offset {at:#x}: bytes {:02x?}",
                    path.display(),
                    &section[at..(at + 16).min(section.len())]
                );
            }
            assert_eq!(want.len(), got.len(), "{} {name}", path.display());
            assert_eq!(want_calls, got_calls, "{} {name}", path.display());
            if path.to_string_lossy().contains("libc") {
                libc_calls += got_calls;
            }
            checked += want.len();
        }
    }
    eprintln!(
        "{checked} instructions decoded alike; the C library makes {libc_calls} raw system calls"
    );
    assert!(checked > 1_000_000, "{checked}");
}
