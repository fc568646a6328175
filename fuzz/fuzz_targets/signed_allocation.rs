//! A pod's allocation and signature annotations and a container's kubelet annotations, as the
//! NRI plugin meets them: `injection::decide` never panics, and grants only what a signature
//! made here covers.
#![no_main]
use std::collections::BTreeMap;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_core::enforcement::ShareEnforcement;
use tessera_core::handoff::{SigningKeys, VerifyingKeys};
use tessera_core::injection::{self, Injection, NodeContext};

fn keys() -> &'static VerifyingKeys {
    static KEYS: OnceLock<VerifyingKeys> = OnceLock::new();
    KEYS.get_or_init(|| {
        SigningKeys::new("k", [("k".to_string(), vec![3u8; 32])])
            .unwrap()
            .verifying()
    })
}

fuzz_target!(|input: (String, String, String, Vec<(String, String)>)| {
    let (allocation, signature, container, annotations) = input;
    let ready = |_: &str| Ok(());
    let ctx = NodeContext {
        node: "node-a",
        keys: keys(),
        enforcement: ShareEnforcement::Mps,
        share_ready: &ready,
    };
    let pod: BTreeMap<String, String> = [
        (tessera_core::names::ANNOTATION_ALLOCATION.to_string(), allocation),
        (
            tessera_core::names::ANNOTATION_ALLOCATION_SIGNATURE.to_string(),
            signature,
        ),
    ]
    .into();
    let ctr: BTreeMap<String, String> = annotations.into_iter().collect();
    if let Ok(Injection::Grant(_)) = injection::decide(&ctx, "uid", &pod, &container, &ctr) {
        panic!("granted on a signature no key here made");
    }
});
