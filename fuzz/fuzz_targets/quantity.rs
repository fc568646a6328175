//! Kubernetes quantities as pods write them: never a panic, and a parsed amount converts
//! without overflow.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_core::quantity::Amount;

fuzz_target!(|s: &str| {
    if let Ok(a) = Amount::parse(s) {
        let _ = (a.milli_ceil(), a.ceil(), a.as_integer());
    }
});
