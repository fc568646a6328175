//! Stream capture hooks: where the container's processes take turns, a process does not hand
//! its turn over while it captures a stream into a graph (the handover's synchronisation would
//! invalidate the capture).

use std::ffi::{c_int, c_void};

use crate::ffi::{CUDA_SUCCESS, CuResult, Handle};
use crate::state::{hook, protect};

reals! {
    pub(super) BEGIN = c"cuStreamBeginCapture";
    pub(super) BEGIN_PTSZ = c"cuStreamBeginCapture_ptsz";
    pub(super) BEGIN_V2 = c"cuStreamBeginCapture_v2";
    pub(super) BEGIN_V2_PTSZ = c"cuStreamBeginCapture_v2_ptsz";
    pub(super) BEGIN_TO_GRAPH = c"cuStreamBeginCaptureToGraph";
    pub(super) BEGIN_TO_GRAPH_PTSZ = c"cuStreamBeginCaptureToGraph_ptsz";
    pub(super) END = c"cuStreamEndCapture";
    pub(super) END_PTSZ = c"cuStreamEndCapture_ptsz";
}

/// Runs `begin`, the process's turn kept from before it is called until the capture ends (or
/// failed to begin).
fn began(begin: impl FnOnce() -> CuResult) -> CuResult {
    let turns = hook().and_then(|h| protect(None, || h.gate()));
    if let Some(t) = turns {
        t.capture_began();
    }
    let r = begin();
    if r != CUDA_SUCCESS
        && let Some(t) = turns
    {
        t.capture_ended();
    }
    r
}

fn ended(r: CuResult) -> CuResult {
    if let Some(t) = hook().and_then(|h| protect(None, || h.gate())) {
        t.capture_ended();
    }
    r
}

macro_rules! begin_v1 {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: Handle) -> CuResult {
            type F = unsafe extern "C" fn(Handle) -> CuResult;
            began(|| call!($real, F, stream))
        }
    };
}
begin_v1!(cuStreamBeginCapture, BEGIN);
begin_v1!(cuStreamBeginCapture_ptsz, BEGIN_PTSZ);

macro_rules! begin_v2 {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: Handle, mode: c_int) -> CuResult {
            type F = unsafe extern "C" fn(Handle, c_int) -> CuResult;
            began(|| call!($real, F, stream, mode))
        }
    };
}
begin_v2!(cuStreamBeginCapture_v2, BEGIN_V2);
begin_v2!(cuStreamBeginCapture_v2_ptsz, BEGIN_V2_PTSZ);

macro_rules! begin_to_graph {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            stream: Handle,
            graph: Handle,
            dependencies: *const Handle,
            edge_data: *const c_void,
            count: usize,
            mode: c_int,
        ) -> CuResult {
            type F = unsafe extern "C" fn(Handle, Handle, *const Handle, *const c_void, usize, c_int) -> CuResult;
            began(|| call!($real, F, stream, graph, dependencies, edge_data, count, mode))
        }
    };
}
begin_to_graph!(cuStreamBeginCaptureToGraph, BEGIN_TO_GRAPH);
begin_to_graph!(cuStreamBeginCaptureToGraph_ptsz, BEGIN_TO_GRAPH_PTSZ);

macro_rules! end {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: Handle, graph: *mut Handle) -> CuResult {
            type F = unsafe extern "C" fn(Handle, *mut Handle) -> CuResult;
            ended(call!($real, F, stream, graph))
        }
    };
}
end!(cuStreamEndCapture, END);
end!(cuStreamEndCapture_ptsz, END_PTSZ);
