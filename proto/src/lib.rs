//! Generated protocol code, one module per protocol, each behind a feature so a component
//! compiles only what it speaks.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

/// CRI `runtime.v1`, the subset the end-to-end tests drive (client only).
#[cfg(feature = "cri")]
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod cri {
    tonic::include_proto!("runtime.v1");
}

/// Kubelet device plugin API `v1beta1` (Registration and DevicePlugin, client and server).
#[cfg(feature = "deviceplugin")]
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");
}

/// The kubelet's plugin registration API (`pluginregistration`, v1).
#[cfg(feature = "dra")]
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The kubelet's DRA plugin API `k8s.io.kubelet.pkg.apis.dra.v1` (client and server).
#[cfg(feature = "dra")]
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod dra {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// The kubelet's DRA device health API `v1alpha1` (`DRAResourceHealth`, client and server).
#[cfg(feature = "dra")]
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod drahealth {
    tonic::include_proto!("v1alpha1");
}

/// NRI `nri.pkg.api.v1alpha1` (rust-protobuf messages, async ttrpc client and server).
#[cfg(feature = "nri")]
#[allow(
    clippy::all,
    clippy::pedantic,
    missing_docs,
    unused_imports,
    unused_qualifications,
    nonstandard_style,
    unused_mut,
    dead_code
)]
pub mod nri {
    /// Messages.
    pub mod api {
        include!(concat!(env!("OUT_DIR"), "/nri/api.rs"));
    }
    /// ttrpc services.
    pub mod api_ttrpc {
        include!(concat!(env!("OUT_DIR"), "/nri/api_ttrpc.rs"));
    }
}
