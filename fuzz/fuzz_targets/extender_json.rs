//! The extender's verbs' bodies (filter and prioritize, bind, preempt): parsed as the HTTP
//! layer parses them, never a panic. The wire types are compiled in from their source (they
//! need only serde and k8s-openapi), which keeps the extender's server stack out of the fuzz
//! build.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../extender/src/service/wire.rs"]
mod wire;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<wire::ExtenderArgs<'_>>(data);
    let _ = serde_json::from_slice::<wire::ExtenderBindingArgs>(data);
    let _ = serde_json::from_slice::<wire::ExtenderPreemptionArgs>(data);
});
