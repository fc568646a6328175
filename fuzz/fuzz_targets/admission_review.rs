//! An AdmissionReview as the API server posts it to the claims webhook: parsed, and the pod's
//! claim references read, never a panic.
#![no_main]
use kube::core::admission::AdmissionReview;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(review) = serde_json::from_slice::<AdmissionReview<k8s_openapi::api::core::v1::Pod>>(data) else {
        return;
    };
    let req: Result<kube::core::admission::AdmissionRequest<k8s_openapi::api::core::v1::Pod>, _> = review.try_into();
    let Ok(req) = req else {
        return;
    };
    if let Some(pod) = &req.object {
        let _ = tessera_api::pod::names_claims(pod);
        let _ = tessera_api::pod::claim_refs(pod);
    }
});
