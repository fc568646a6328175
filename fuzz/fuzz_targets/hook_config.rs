//! The CUDA hook's per-container configuration file: parsed, never a panic. The module is
//! compiled in from its source: linking the hook library itself would interpose `dlsym` in the
//! fuzzer too.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../hook/src/config.rs"]
mod config;

fuzz_target!(|s: &str| {
    let _ = config::Config::parse(s);
});
