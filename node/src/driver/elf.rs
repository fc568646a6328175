//! The one thing Tessera reads from a driver library's ELF headers: its `DT_SONAME`, the name
//! the dynamic loader looks it up by (`libcuda.so.1`, `libnvidia-nvvm.so.4`,
//! `libnvidia-gpucomp.so.<version>`). Only the headers are read, with positioned reads.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: u64 = 0;
const DT_STRTAB: u64 = 5;
const DT_SONAME: u64 = 14;
/// More dynamic entries than any library has: a bound on a corrupt file.
const MAX_DYNAMIC: u64 = 4096;

fn read<const N: usize>(f: &File, at: u64) -> Option<[u8; N]> {
    let mut b = [0u8; N];
    f.read_exact_at(&mut b, at).ok()?;
    Some(b)
}

fn u16_at(f: &File, at: u64) -> Option<u16> {
    read::<2>(f, at).map(u16::from_le_bytes)
}

fn u32_at(f: &File, at: u64) -> Option<u32> {
    read::<4>(f, at).map(u32::from_le_bytes)
}

fn u64_at(f: &File, at: u64) -> Option<u64> {
    read::<8>(f, at).map(u64::from_le_bytes)
}

/// The `DT_SONAME` of a 64-bit little-endian ELF shared object; `None` for anything else
/// (another format, no soname, a corrupt file).
pub fn soname(path: &Path) -> Option<String> {
    let f = File::open(path).ok()?;
    let ident = read::<6>(&f, 0)?;
    // Magic, ELFCLASS64, ELFDATA2LSB.
    if ident[..4] != *b"\x7fELF" || ident[4] != 2 || ident[5] != 1 {
        return None;
    }
    let phoff = u64_at(&f, 0x20)?;
    let phentsize = u64::from(u16_at(&f, 0x36)?);
    let phnum = u64::from(u16_at(&f, 0x38)?);
    let mut loads = Vec::new();
    let mut dynamic = None;
    for i in 0..phnum {
        let at = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let kind = u32_at(&f, at)?;
        let (offset, vaddr, filesz) = (u64_at(&f, at + 8)?, u64_at(&f, at + 16)?, u64_at(&f, at + 32)?);
        match kind {
            PT_LOAD => loads.push((offset, vaddr, filesz)),
            PT_DYNAMIC => dynamic = Some((offset, filesz)),
            _ => {}
        }
    }
    let (dyn_off, dyn_size) = dynamic?;
    let (mut strtab, mut name) = (None, None);
    for i in 0..(dyn_size / 16).min(MAX_DYNAMIC) {
        let at = dyn_off + i * 16;
        match (u64_at(&f, at)?, u64_at(&f, at + 8)?) {
            (DT_NULL, _) => break,
            (DT_STRTAB, v) => strtab = Some(v),
            (DT_SONAME, v) => name = Some(v),
            _ => {}
        }
    }
    let (strtab, name) = (strtab?, name?);
    // DT_STRTAB is a virtual address: map it to a file offset through the loadable segments.
    let (off, vaddr, _) = loads
        .iter()
        .find(|(_, vaddr, size)| strtab >= *vaddr && strtab < vaddr + size)?;
    let start = off + (strtab - vaddr) + name;
    let mut buf = [0u8; 256];
    let n = f.read_at(&mut buf, start).ok()?;
    let end = buf[..n].iter().position(|&b| b == 0)?;
    std::str::from_utf8(&buf[..end]).ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_soname_of_a_system_library() {
        // This test binary links glibc: find the libc it loaded.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let libc = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libc.so.6") || p.contains("/libc-"))
            .expect("libc is mapped");
        assert_eq!(soname(Path::new(libc)).as_deref(), Some("libc.so.6"));
    }

    #[test]
    fn non_elf_files_have_none() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libfake.so.1");
        std::fs::write(&p, b"fake").unwrap();
        assert_eq!(soname(&p), None);
        std::fs::write(&p, b"\x7fELF\x02\x01garbage").unwrap();
        assert_eq!(soname(&p), None);
        assert_eq!(soname(&dir.path().join("absent")), None);
    }
}
