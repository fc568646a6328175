//! The extender's verbs' bodies (filter and prioritize, bind, preempt): parsed as the HTTP
//! layer parses them, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_extender::service::wire::{ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs};

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<ExtenderArgs<'_>>(data);
    let _ = serde_json::from_slice::<ExtenderBindingArgs>(data);
    let _ = serde_json::from_slice::<ExtenderPreemptionArgs>(data);
});
