//! Tessera's bindings to NVML's per-cgroup memory limits (`memory_limits::ffi`) against
//! NVIDIA's own header (`nvml.h` of PyPI's `nvidia-nvml-dev`, fetched by
//! tests/nvidia/nvml-header.sh): the structs' sizes and field offsets, the constants, and each
//! function's prototype, checked by a C compiler.

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_node::memory_limits::{NO_LIMIT, ffi};

fn header() -> PathBuf {
    let out = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/nvidia/nvml-header.sh"))
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "tests/nvidia/nvml-header.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A C program that fails to compile where a prototype differs, and prints the layouts.
fn program() -> String {
    let mut c = String::from("#include <stddef.h>\n#include <stdio.h>\n#include \"nvml.h\"\n");
    for (name, ty) in [
        ("nvmlInit_v2", "nvmlReturn_t (*)(void)"),
        ("nvmlErrorString", "const char *(*)(nvmlReturn_t)"),
        ("nvmlSystemGetDriverVersion", "nvmlReturn_t (*)(char *, unsigned int)"),
        (
            "nvmlDeviceGetHandleByUUID",
            "nvmlReturn_t (*)(const char *, nvmlDevice_t *)",
        ),
        (
            "nvmlDeviceSetMemoryLimits_v1",
            "nvmlReturn_t (*)(nvmlDevice_t, nvmlSetMemoryLimits_v1_t *)",
        ),
        (
            "nvmlDeviceGetMemoryLimits_v1",
            "nvmlReturn_t (*)(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *)",
        ),
    ] {
        assert!(ffi::SYMBOLS.contains(&name), "{name} is not among the bound symbols");
        c += &format!("_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), {ty}), \"{name}\");\n");
    }
    c += "_Static_assert(sizeof(nvmlReturn_t) == 4, \"nvmlReturn_t\");\n";
    c += "_Static_assert(sizeof(nvmlDevice_t) == sizeof(void *), \"nvmlDevice_t\");\n";
    c += r#"int main(void) {
    printf("set %zu %zu %zu %zu\n", sizeof(nvmlSetMemoryLimits_v1_t), offsetof(nvmlSetMemoryLimits_v1_t, nameSpace),
           offsetof(nvmlSetMemoryLimits_v1_t, softLimit), offsetof(nvmlSetMemoryLimits_v1_t, hardLimit));
    printf("get %zu %zu %zu %zu %zu\n", sizeof(nvmlGetMemoryLimits_v1_t), offsetof(nvmlGetMemoryLimits_v1_t, nameSpace),
           offsetof(nvmlGetMemoryLimits_v1_t, softLimit), offsetof(nvmlGetMemoryLimits_v1_t, hardLimit),
           offsetof(nvmlGetMemoryLimits_v1_t, currentUsed));
    printf("limit_max %llu\n", (unsigned long long)NVML_DEVICE_MEMORY_LIMIT_MAX);
    printf("success %d\nnot_found %d\n", (int)NVML_SUCCESS, (int)NVML_ERROR_NOT_FOUND);
    printf("version_buffer %d\n", (int)NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE);
    return 0;
}
"#;
    c
}

#[test]
fn the_bindings_match_nvidias_header() {
    let header = header();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("layout.c");
    std::fs::write(&src, program()).unwrap();
    let exe = dir.path().join("layout");
    let cc = Command::new("cc")
        .arg(format!("-I{}", header.parent().unwrap().display()))
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let out = Command::new(&exe).output().unwrap();
    let printed = String::from_utf8(out.stdout).unwrap();
    type Set = ffi::SetMemoryLimitsV1;
    type Get = ffi::GetMemoryLimitsV1;
    let ours = format!(
        "set {} {} {} {}\nget {} {} {} {} {}\nlimit_max {}\nsuccess {}\nnot_found {}\nversion_buffer {}\n",
        size_of::<Set>(),
        offset_of!(Set, name_space),
        offset_of!(Set, soft_limit),
        offset_of!(Set, hard_limit),
        size_of::<Get>(),
        offset_of!(Get, name_space),
        offset_of!(Get, soft_limit),
        offset_of!(Get, hard_limit),
        offset_of!(Get, current_used),
        NO_LIMIT,
        ffi::NVML_SUCCESS,
        ffi::NVML_ERROR_NOT_FOUND,
        ffi::DRIVER_VERSION_BUFFER_SIZE,
    );
    assert_eq!(printed, ours);
}
