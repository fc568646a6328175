//! A node's published inventory annotation, which the extender reads from every Node: decoded
//! and checked, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_core::inventory::PublishedInventory;

fuzz_target!(|s: &str| {
    let _ = PublishedInventory::decode(s);
});
