//! Following links inside a root: `/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1`
//! may point at `/usr/lib/...` meaning the driver root's `/usr/lib`, never the host's. Every
//! component is resolved in turn (a merged-`/usr` `lib -> usr/lib` included), `..` stops at
//! the root, and a loop ends the walk.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

/// Link expansions allowed in one walk (the kernel's limit).
const MAX_LINKS: usize = 40;

/// `path` (absolute, in the root's namespace) with every link resolved inside `root` (where
/// this process reads the root). `None` when a component is missing or links loop.
pub fn resolve_components(root: &Path, path: &Path) -> Option<PathBuf> {
    let mut todo: VecDeque<OsString> = VecDeque::new();
    push_front(&mut todo, path);
    let mut done: Vec<OsString> = Vec::new();
    let mut links = 0;
    while let Some(c) = todo.pop_front() {
        if c == "." || c.is_empty() {
            continue;
        }
        if c == ".." {
            done.pop();
            continue;
        }
        done.push(c);
        let here: PathBuf = done.iter().collect();
        let meta = std::fs::symlink_metadata(root.join(&here)).ok()?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_LINKS {
                return None;
            }
            let target = std::fs::read_link(root.join(&here)).ok()?;
            done.pop();
            if target.is_absolute() {
                done.clear();
            }
            push_front(&mut todo, &target);
        }
    }
    Some(Path::new("/").join(done.iter().collect::<PathBuf>()))
}

fn push_front(todo: &mut VecDeque<OsString>, p: &Path) {
    for c in p.components().rev() {
        match c {
            Component::Normal(s) => todo.push_front(s.to_os_string()),
            Component::ParentDir => todo.push_front("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
}

/// `path` resolved inside `root` (links followed without leaving it), when it is a regular
/// file.
pub fn resolve_in_root(root: &Path, path: &Path) -> Option<PathBuf> {
    let p = resolve_components(root, path)?;
    std::fs::metadata(root.join(p.strip_prefix("/").unwrap_or(&p)))
        .ok()?
        .is_file()
        .then_some(p)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn links_resolve_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        std::fs::write(r.join("usr/lib/x86_64-linux-gnu/libcuda.so.580.1"), b"x").unwrap();
        // Merged /usr, a relative link, an absolute link meant for the root, and `..`.
        symlink("usr/lib", r.join("lib")).unwrap();
        symlink("libcuda.so.580.1", r.join("usr/lib/x86_64-linux-gnu/libcuda.so.1")).unwrap();
        std::fs::create_dir_all(r.join("opt")).unwrap();
        symlink("/lib/x86_64-linux-gnu/libcuda.so.1", r.join("opt/abs")).unwrap();
        symlink("../usr/./lib/x86_64-linux-gnu/libcuda.so.1", r.join("opt/rel")).unwrap();
        let want = Some(PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.580.1"));
        assert_eq!(
            resolve_in_root(r, Path::new("/lib/x86_64-linux-gnu/libcuda.so.1")),
            want
        );
        assert_eq!(resolve_in_root(r, Path::new("/opt/abs")), want);
        assert_eq!(resolve_in_root(r, Path::new("/opt/rel")), want);
        // `..` cannot climb out of the root.
        assert_eq!(
            resolve_in_root(r, Path::new("/../../usr/lib/x86_64-linux-gnu/libcuda.so.1")),
            want
        );
        // Loops and dangling links are None; a directory is not a file.
        symlink("b", r.join("a")).unwrap();
        symlink("a", r.join("b")).unwrap();
        assert_eq!(resolve_in_root(r, Path::new("/a")), None);
        symlink("/nowhere", r.join("dangling")).unwrap();
        assert_eq!(resolve_in_root(r, Path::new("/dangling")), None);
        assert_eq!(resolve_in_root(r, Path::new("/usr/lib")), None);
        assert_eq!(
            resolve_components(r, Path::new("/lib")),
            Some(PathBuf::from("/usr/lib"))
        );
    }
}
