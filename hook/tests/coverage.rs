//! docs/hook-coverage.md against the real libcuda (Debian's 535 and 550, `tests/nvidia/fetch.sh`)
//! and the hook library: every exported name of the allocating, context and launching families
//! is in the table, and every row marked counted is a function the hook exports.

use std::collections::BTreeMap;
use std::path::Path;

use tessera_tests::nvidia::{Branch, Userspace};

mod common;

/// The families the table must cover.
fn in_scope(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "cuMemAlloc",
        "cuMemCreate",
        "cuMemPoolCreate",
        "cuMemPoolImport",
        "cuMemImportFrom",
        "cuMemHostAlloc",
        "cuMemMapArray",
        "cuArrayCreate",
        "cuArray3DCreate",
        "cuMipmappedArrayCreate",
        "cuGraphAddMemAllocNode",
        "cuModuleLoad",
        "cuLibraryLoad",
        "cuCtxCreate",
        "cuDevicePrimaryCtxRetain",
        "cuIpcOpenMemHandle",
        "cuImportExternalMemory",
        "cuLaunch",
        "cuGraphLaunch",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

#[test]
fn the_coverage_table_matches_the_real_driver_and_the_hook() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/hook-coverage.md")).unwrap();
    let table: BTreeMap<String, bool> = doc
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((name.to_string(), *cells.get(2)? == "counted"))
        })
        .collect();
    assert!(table.len() >= 50, "{table:?}");
    let u = Userspace::get().unwrap();
    for b in Branch::ALL {
        let lib = u.library_dir(b).join(format!("libcuda.so.{}", u.version(b)));
        let missing: Vec<String> = common::exports(&lib)
            .into_iter()
            .filter(|n| in_scope(n) && !table.contains_key(n))
            .collect();
        assert!(
            missing.is_empty(),
            "{b:?}: libcuda exports {missing:?}, not in docs/hook-coverage.md"
        );
    }
    let hooked = common::exports(&common::hook_lib());
    let not_hooked: Vec<&String> = table
        .iter()
        .filter(|(n, counted)| **counted && !hooked.contains(n))
        .map(|(n, _)| n)
        .collect();
    assert!(
        not_hooked.is_empty(),
        "marked counted, not exported by the hook: {not_hooked:?}"
    );
    let unlisted_hooks: Vec<&String> = hooked
        .iter()
        .filter(|n| in_scope(n) && !table.get(*n).copied().unwrap_or(false))
        .collect();
    assert!(
        unlisted_hooks.is_empty(),
        "hooked but not marked counted: {unlisted_hooks:?}"
    );
}
