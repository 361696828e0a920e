//! Residency of host memory pages: advice to read ahead or give back, locking, and how much of
//! a range is in memory. Models use these on weights mapped from a file (MoE experts) to keep
//! what they need resident and let the rest go.

use crate::abi::error::UError;

/// The OS page size.
#[cfg(unix)]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    }
}

/// `addr..addr + len` widened to whole pages: (page-aligned start, length).
#[cfg(unix)]
fn pages(addr: usize, len: usize) -> (*mut libc::c_void, usize) {
    let start = addr & !(page_size() - 1);
    (start as *mut libc::c_void, addr + len - start)
}

/// `madvise(MADV_WILLNEED)`: schedule reads of the pages holding `addr..addr + len`.
#[cfg(unix)]
pub fn will_need(addr: usize, len: usize) {
    let (start, len) = pages(addr, len);
    // SAFETY: MADV_WILLNEED only schedules reads of this process's own mappings; it changes no
    // contents, and a range that is not mapped just makes the call fail.
    unsafe { libc::madvise(start, len, libc::MADV_WILLNEED) };
}

/// `madvise(MADV_RANDOM)`: the pages holding `addr..addr + len` are read in random order, so a
/// fault reads only its page rather than the OS's read-ahead window around it. Advice only.
#[cfg(unix)]
pub fn random_access(addr: usize, len: usize) {
    let (start, len) = pages(addr, len);
    // SAFETY: MADV_RANDOM only changes how faults read ahead; contents never change.
    unsafe { libc::madvise(start, len, libc::MADV_RANDOM) };
}

/// `madvise(MADV_PAGEOUT)`: reclaim the pages holding `addr..addr + len` (Linux 5.4+; file
/// pages are dropped and read again on the next touch, contents unchanged). Advice only.
#[cfg(target_os = "linux")]
pub fn page_out(addr: usize, len: usize) {
    let (start, len) = pages(addr, len);
    // SAFETY: MADV_PAGEOUT never changes what the memory reads as: clean file pages are
    // re-read, dirty or anonymous ones written back or swapped first. Unmapped ranges fail.
    unsafe { libc::madvise(start, len, libc::MADV_PAGEOUT) };
}

/// `mlock`: keep the pages holding `addr..addr + len` in memory.
#[cfg(unix)]
pub fn lock(addr: usize, len: usize) -> Result<(), UError> {
    let (start, len) = pages(addr, len);
    // SAFETY: mlock changes residency only, never contents.
    if unsafe { libc::mlock(start, len) } == 0 {
        Ok(())
    } else {
        Err(UError::io(
            format!("mlock of {len} bytes (RLIMIT_MEMLOCK, CAP_IPC_LOCK)"),
            std::io::Error::last_os_error(),
        ))
    }
}

/// `munlock`: undo [`lock`].
#[cfg(unix)]
pub fn unlock(addr: usize, len: usize) {
    let (start, len) = pages(addr, len);
    // SAFETY: munlock changes residency only, never contents.
    unsafe { libc::munlock(start, len) };
}

/// Bytes of `addr..addr + len` whose pages are in memory (`mincore`), or `None` where the
/// call fails (the range is not mapped).
#[cfg(unix)]
pub fn resident_bytes(addr: usize, len: usize) -> Option<u64> {
    let page = page_size();
    let (start, span) = pages(addr, len);
    let mut flags = vec![0u8; span.div_ceil(page)];
    // SAFETY: `flags` holds one byte per page of the range, as mincore writes.
    if unsafe { libc::mincore(start, span, flags.as_mut_ptr().cast()) } != 0 {
        return None;
    }
    let resident = flags.iter().filter(|&&f| f & 1 == 1).count() as u64;
    Some((resident * page as u64).min(len as u64))
}

/// No read-ahead advice off Unix.
#[cfg(not(unix))]
pub fn will_need(_addr: usize, _len: usize) {}

/// No read-ahead advice off Unix.
#[cfg(not(unix))]
pub fn random_access(_addr: usize, _len: usize) {}

/// No reclaim advice off Linux.
#[cfg(not(target_os = "linux"))]
pub fn page_out(_addr: usize, _len: usize) {}

/// Locking is not offered off Unix.
#[cfg(not(unix))]
pub fn lock(_addr: usize, _len: usize) -> Result<(), UError> {
    Err(UError::unsupported("locking pages needs a Unix OS"))
}

/// Nothing to unlock off Unix.
#[cfg(not(unix))]
pub fn unlock(_addr: usize, _len: usize) {}

/// Residency is unknown off Unix.
#[cfg(not(unix))]
pub fn resident_bytes(_addr: usize, _len: usize) -> Option<u64> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file mapping's pages come in when touched, leave on page-out, stay through it when
    /// locked (where the memlock limit allows), and read the same throughout.
    #[test]
    fn pages_of_a_mapped_file_come_and_go_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weights.bin");
        let data: Vec<u8> = (0..(1u32 << 22)).map(|i| (i * 7 % 251) as u8).collect();
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(&data).unwrap();
        file.sync_all().unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the file is ours and not written while mapped.
        let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
        let (addr, len) = (map.as_ptr() as usize, map.len());
        assert_eq!(
            map.iter().map(|&b| u64::from(b)).sum::<u64>(),
            data.iter().map(|&b| u64::from(b)).sum::<u64>()
        );
        assert_eq!(resident_bytes(addr, len), Some(len as u64));
        page_out(addr, len);
        let out = resident_bytes(addr, len).unwrap();
        assert!(
            out < len as u64 / 4,
            "{out} of {len} bytes still resident after page-out"
        );
        will_need(addr, len);
        assert_eq!(&map[..], &data[..]);
        assert_eq!(resident_bytes(addr, len), Some(len as u64));
        if lock(addr, len).is_ok() {
            page_out(addr, len);
            assert_eq!(
                resident_bytes(addr, len),
                Some(len as u64),
                "locked pages left"
            );
            unlock(addr, len);
        }
        assert_eq!(resident_bytes(0, 4096), None);
    }
}
