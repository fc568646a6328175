//! Why a MIG instance could not be made or destroyed, naming the step that failed.

use thiserror::Error;

/// Why a [`super::MigPartitioner`] could not make or destroy an instance.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MigError {
    /// An NVML call returned an error code.
    #[error("{call}: {message} (NVML return code {rc})")]
    Nvml {
        /// The NVML function.
        call: &'static str,
        /// NVML's own words for `rc`.
        message: String,
        /// The return code.
        rc: u32,
    },
    /// An NVML call through the wrapper failed (`target`: what it was asked about, if anything).
    #[error("{call}{}: {message}", target.as_ref().map(|t| format!("({t})")).unwrap_or_default())]
    Call {
        /// The NVML function.
        call: &'static str,
        /// The card or device it was asked about.
        target: Option<String>,
        /// Why it failed.
        message: String,
    },
    /// The node's libnvidia-ml lacks an entry point dynamic MIG calls.
    #[error("{symbol}: not in this libnvidia-ml: {reason}")]
    Missing {
        /// The entry point.
        symbol: &'static str,
        /// Why it could not be loaded.
        reason: String,
    },
    /// The card cannot make instances of the profile.
    #[error("GPU instance profile {profile} is not one of card {card}'s")]
    NoSuchProfile {
        /// The card's UUID.
        card: String,
        /// The NVML profile id.
        profile: u32,
    },
    /// No compute instance profile covers a GPU instance of that size.
    #[error("no compute instance profile covers a {slices}-slice GPU instance")]
    NoComputeProfile {
        /// The GPU instance's memory slices.
        slices: u32,
    },
    /// The instance was made but no MIG device shows it.
    #[error("no MIG device for GPU instance {gi} compute instance {ci}")]
    NoMigDevice {
        /// GPU instance id.
        gi: u32,
        /// Compute instance id.
        ci: u32,
    },
    /// A creation failed and what it had made could not be destroyed (both reasons said).
    #[error("{made}; the half-made GPU instance could not be destroyed: {left}")]
    LeftHalfMade {
        /// Why the creation failed.
        made: Box<MigError>,
        /// Why its undoing failed.
        left: Box<MigError>,
    },
    /// Where a creation failed: the card, profile and placement, then why (the whole chain in
    /// one message, as a claim's status shows it).
    #[error("card {card}, GPU instance profile {profile} at {start}:{size}: {reason}")]
    Create {
        /// The card's UUID.
        card: String,
        /// The NVML profile id.
        profile: u32,
        /// First memory slice.
        start: u32,
        /// Memory slices.
        size: u32,
        /// Why.
        reason: Box<MigError>,
    },
    /// A MIG device's GPU and compute instance ids could not be read (the inventory's words).
    #[error("{0}")]
    InstanceIds(String),
    /// The node's libnvidia-ml lacks entry points dynamic MIG calls (a driver before them).
    #[error("this libnvidia-ml lacks {missing:?}: MIG instances cannot be created per claim")]
    Unsupported {
        /// The entry points it lacks.
        missing: Vec<&'static str>,
    },
    /// A fixture node's instances (a file standing for the card) could not be changed.
    #[error("{0}")]
    Fixture(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim's status shows the whole chain in one line, each step named as before the
    /// errors were typed.
    #[test]
    fn each_step_is_named_in_one_line() {
        let nvml = MigError::Nvml {
            call: "nvmlGpuInstanceCreateComputeInstance",
            message: "Insufficient Resources".into(),
            rc: 23,
        };
        let left = MigError::Call {
            call: "nvmlDeviceGetHandleByUUID",
            target: Some("GPU-1".into()),
            message: "Not Found".into(),
        };
        let e = MigError::Create {
            card: "GPU-1".into(),
            profile: 9,
            start: 0,
            size: 4,
            reason: Box::new(nvml.clone()),
        };
        assert_eq!(
            e.to_string(),
            "card GPU-1, GPU instance profile 9 at 0:4: nvmlGpuInstanceCreateComputeInstance: \
             Insufficient Resources (NVML return code 23)"
        );
        let half = MigError::LeftHalfMade {
            made: Box::new(nvml),
            left: Box::new(left),
        };
        assert_eq!(
            half.to_string(),
            "nvmlGpuInstanceCreateComputeInstance: Insufficient Resources (NVML return code 23); the \
             half-made GPU instance could not be destroyed: nvmlDeviceGetHandleByUUID(GPU-1): Not Found"
        );
        let count = MigError::Call {
            call: "nvmlDeviceGetMaxMigDeviceCount",
            target: None,
            message: "Unknown Error".into(),
        };
        assert_eq!(count.to_string(), "nvmlDeviceGetMaxMigDeviceCount: Unknown Error");
    }
}
