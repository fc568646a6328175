//! glibc's `/etc/ld.so.cache`, read the way `ld.so` reads it (`elf/dl-cache.c`).
//!
//! Three layouts exist, all little-endian on the machines Tessera runs on:
//! - **new** (glibc 2.32+ default): `glibc-ld.so.cache1.1`, a 48-byte header, 24-byte entries;
//!   string offsets count from the start of that header;
//! - **old** (`ld.so-1.7.0`): a 16-byte header, 12-byte entries; string offsets count from the
//!   end of the entries;
//! - **compat** (what older distributions write): the old layout with the new one hidden after
//!   its entries at the next 8-byte boundary. `ld.so` prefers the hidden new table, and so do we.

use std::path::Path;

use thiserror::Error;

const MAGIC_OLD: &[u8] = b"ld.so-1.7.0";
const MAGIC_NEW: &[u8] = b"glibc-ld.so.cache1.1";
const OLD_HEADER: usize = 16;
const OLD_ENTRY: usize = 12;
const NEW_HEADER: usize = 48;
const NEW_ENTRY: usize = 24;
/// `FLAG_ELF_LIBC6`: an ELF library for glibc.
const FLAG_ELF_LIBC6: i32 = 0x0003;
const FLAG_TYPE_MASK: i32 = 0x00ff;
const FLAG_REQUIRED_MASK: i32 = 0xff00;
/// The new header's `flags` byte: endianness (0 unset, 2 little, 3 big).
const ENDIAN_BIG: u8 = 3;

/// Why a cache could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LdCacheError {
    /// Neither magic string.
    #[error("not an ld.so.cache (unknown magic {0:?})")]
    BadMagic(String),
    /// A count or offset points outside the file.
    #[error("truncated or corrupt ld.so.cache: {0}")]
    Corrupt(String),
    /// Written for a big-endian machine.
    #[error("ld.so.cache is big-endian; this build reads little-endian caches")]
    BigEndian,
}

/// One library the cache knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// ld.so's flags: type in the low byte, architecture in the high byte.
    pub flags: i32,
    /// The library's soname (`libcuda.so.1`).
    pub soname: String,
    /// Its path, in the cache's root (`/usr/lib/x86_64-linux-gnu/libcuda.so.1`).
    pub path: String,
}

/// The entries of one cache file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LdCache {
    /// In file order (ld.so's lookup order).
    pub entries: Vec<CacheEntry>,
}

/// The architecture byte ld.so uses for 64-bit libraries of this build's machine.
pub fn native_arch_flag() -> i32 {
    match std::env::consts::ARCH {
        "x86_64" => 0x0300,
        "aarch64" => 0x0a00,
        "powerpc64" => 0x0500,
        _ => 0,
    }
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, LdCacheError> {
    data.get(at..at + 4)
        .map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")))
        .ok_or_else(|| LdCacheError::Corrupt(format!("no 4 bytes at offset {at}")))
}

fn str_at(data: &[u8], at: usize) -> Result<String, LdCacheError> {
    let tail = data
        .get(at..)
        .ok_or_else(|| LdCacheError::Corrupt(format!("string offset {at} past the end")))?;
    let end = tail
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| LdCacheError::Corrupt(format!("unterminated string at {at}")))?;
    Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
}

impl LdCache {
    /// Reads a cache file.
    pub fn read(path: &Path) -> Result<Self, LdCacheError> {
        let data =
            std::fs::read(path).map_err(|e| LdCacheError::Corrupt(format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&data)
    }

    /// Parses a cache's bytes.
    pub fn parse(data: &[u8]) -> Result<Self, LdCacheError> {
        if data.starts_with(MAGIC_NEW) {
            return Self::parse_new(data, 0);
        }
        if !data.starts_with(MAGIC_OLD) {
            let head = String::from_utf8_lossy(&data[..data.len().min(20)]).into_owned();
            return Err(LdCacheError::BadMagic(head));
        }
        let n = u32_at(data, 12)? as usize;
        let end = n
            .checked_mul(OLD_ENTRY)
            .and_then(|s| s.checked_add(OLD_HEADER))
            .filter(|&e| e <= data.len())
            .ok_or_else(|| LdCacheError::Corrupt(format!("{n} old-format entries do not fit")))?;
        let hidden = end.next_multiple_of(8);
        if data.get(hidden..).is_some_and(|t| t.starts_with(MAGIC_NEW)) {
            return Self::parse_new(data, hidden);
        }
        let mut entries = Vec::with_capacity(n);
        for i in 0..n {
            let at = OLD_HEADER + i * OLD_ENTRY;
            entries.push(CacheEntry {
                flags: u32_at(data, at)? as i32,
                soname: str_at(data, end + u32_at(data, at + 4)? as usize)?,
                path: str_at(data, end + u32_at(data, at + 8)? as usize)?,
            });
        }
        Ok(Self { entries })
    }

    fn parse_new(data: &[u8], base: usize) -> Result<Self, LdCacheError> {
        let n = u32_at(data, base + 20)? as usize;
        if data.get(base + 28) == Some(&ENDIAN_BIG) {
            return Err(LdCacheError::BigEndian);
        }
        n.checked_mul(NEW_ENTRY)
            .and_then(|s| s.checked_add(base + NEW_HEADER))
            .filter(|&e| e <= data.len())
            .ok_or_else(|| LdCacheError::Corrupt(format!("{n} entries do not fit")))?;
        let mut entries = Vec::with_capacity(n);
        for i in 0..n {
            let at = base + NEW_HEADER + i * NEW_ENTRY;
            entries.push(CacheEntry {
                flags: u32_at(data, at)? as i32,
                soname: str_at(data, base + u32_at(data, at + 4)? as usize)?,
                path: str_at(data, base + u32_at(data, at + 8)? as usize)?,
            });
        }
        Ok(Self { entries })
    }

    /// glibc ELF libraries of the architecture `arch_flag` (see [`native_arch_flag`]).
    pub fn for_arch(&self, arch_flag: i32) -> impl Iterator<Item = &CacheEntry> {
        self.entries
            .iter()
            .filter(move |e| e.flags & FLAG_TYPE_MASK == FLAG_ELF_LIBC6 && e.flags & FLAG_REQUIRED_MASK == arch_flag)
    }

    /// The first native entry whose soname is `stem.so.<anything>` (`libcuda` finds
    /// `libcuda.so.1`, not `libcudart.so.12`), as ld.so would pick it.
    pub fn find(&self, stem: &str) -> Option<&CacheEntry> {
        self.for_arch(native_arch_flag()).find(|e| {
            e.soname
                .strip_prefix(stem)
                .and_then(|r| r.strip_prefix(".so."))
                .is_some_and(|v| !v.is_empty())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new-format cache written by hand (offsets from the header).
    fn new_format(entries: &[(i32, &str, &str)]) -> Vec<u8> {
        let mut strings = Vec::new();
        let table = NEW_HEADER + entries.len() * NEW_ENTRY;
        let mut offs = Vec::new();
        for (_, k, v) in entries {
            let ko = table + strings.len();
            strings.extend_from_slice(k.as_bytes());
            strings.push(0);
            let vo = table + strings.len();
            strings.extend_from_slice(v.as_bytes());
            strings.push(0);
            offs.push((ko as u32, vo as u32));
        }
        let mut d = MAGIC_NEW.to_vec();
        d.extend((entries.len() as u32).to_le_bytes());
        d.extend((strings.len() as u32).to_le_bytes());
        d.push(2);
        d.extend([0u8; 3 + 4 + 12]);
        for ((f, _, _), (k, v)) in entries.iter().zip(offs) {
            d.extend(f.to_le_bytes());
            d.extend(k.to_le_bytes());
            d.extend(v.to_le_bytes());
            d.extend([0u8; 4 + 8]);
        }
        d.extend(strings);
        d
    }

    #[test]
    fn new_format_by_hand() {
        let arch = native_arch_flag() | FLAG_ELF_LIBC6;
        let d = new_format(&[
            (FLAG_ELF_LIBC6, "libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1"),
            (arch, "libcudart.so.12", "/usr/local/cuda/lib64/libcudart.so.12"),
            (arch, "libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        ]);
        let c = LdCache::parse(&d).unwrap();
        assert_eq!(c.entries.len(), 3);
        // The 32-bit entry and the libcudart prefix are skipped.
        assert_eq!(
            c.find("libcuda").unwrap().path,
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
        );
        assert!(c.find("libnvidia-ml").is_none());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(matches!(LdCache::parse(b"hello"), Err(LdCacheError::BadMagic(_))));
        let mut d = new_format(&[(0x0303, "a.so.1", "/a")]);
        d.truncate(60);
        assert!(matches!(LdCache::parse(&d), Err(LdCacheError::Corrupt(_))));
        let mut d = MAGIC_OLD.to_vec();
        d.push(0);
        d.extend(u32::MAX.to_le_bytes());
        assert!(matches!(LdCache::parse(&d), Err(LdCacheError::Corrupt(_))));
        let mut d = new_format(&[(0x0303, "a.so.1", "/a")]);
        d[28] = ENDIAN_BIG;
        assert_eq!(LdCache::parse(&d), Err(LdCacheError::BigEndian));
    }
}
