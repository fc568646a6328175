//! Generated protocol code, one module per protocol, each behind a feature so a component
//! compiles only what it speaks.

/// CRI `runtime.v1`, the subset the end-to-end tests drive (client only).
#[cfg(feature = "cri")]
#[allow(clippy::all, missing_docs)]
pub mod cri {
    tonic::include_proto!("runtime.v1");
}

/// Kubelet device plugin API `v1beta1` (Registration and DevicePlugin, client and server).
#[cfg(feature = "deviceplugin")]
#[allow(clippy::all, missing_docs)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}
