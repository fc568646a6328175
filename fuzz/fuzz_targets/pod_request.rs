//! A pod as the API server hands it to the extender (any JSON that deserializes as a Pod):
//! reading its request and its placement demand never panics, and what is accepted is bounded
//! (a count bomb is refused, not expanded).
#![no_main]
use libfuzzer_sys::fuzz_target;
use tessera_core::placement::PodDemand;
use tessera_core::request::{PodRequest, RequestOptions};

fuzz_target!(|data: &[u8]| {
    let Ok(pod) = serde_json::from_slice::<k8s_openapi::api::core::v1::Pod>(data) else {
        return;
    };
    if let Ok(req) = PodRequest::from_pod(&pod, &RequestOptions::default()) {
        let demand = PodDemand::from_request(&req);
        let _ = demand.gpu_milli();
    }
});
