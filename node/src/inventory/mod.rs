//! The node's inventory read off the machine: [`NvmlSource`] (the driver, through NVML, with
//! its files found by [`crate::driver`]), [`FixtureWithHostDriver`] (a fixture's GPUs with this
//! machine's real driver files) and the device nodes a fake node needs
//! ([`create_device_nodes`]).

mod devnodes;
mod host_driver;
mod nvml;
mod nvml_mig;
mod nvml_topology;

pub use devnodes::create_device_nodes;
pub use host_driver::FixtureWithHostDriver;
pub use nvml::NvmlSource;
pub use nvml_mig::{ENTRY_POINTS as MIG_ENTRY_POINTS, NvmlMig, missing_entry_points as missing_mig_entry_points};
