//! Generated protocol code. Each protocol arrives with the component that speaks it:
//! the kubelet device plugin API (device-plugin), NRI (nri-plugin) and the CRI subset the
//! end-to-end tests drive.
