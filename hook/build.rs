//! The hook is preloaded into every process of a share container, including images that have
//! no libgcc_s: a missing dependency of a preloaded library stops every program there. So the
//! unwinder Rust's std links (`-lgcc_s`) is taken from gcc's static archives instead: a linker
//! script named libgcc_s.so, found first, stands for them. glibc is then the only dependency.

use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("libgcc_s.so"), "INPUT(-lgcc_eh -lgcc)\n").expect("writing the linker script");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rerun-if-changed=build.rs");
}
