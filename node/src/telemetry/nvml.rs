//! Telemetry from NVML: memory and utilization per card, and per process (memory from the
//! compute process list, SM share from the process utilization samples since the last call).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

use super::{GpuSample, ProcessSample, TelemetrySource};

/// NVML, initialised once; remembers each card's last sample time and counts its XIDs.
pub struct NvmlTelemetry {
    nvml: Arc<Nvml>,
    last_seen: Mutex<HashMap<String, u64>>,
    xids: Arc<Mutex<HashMap<String, u64>>>,
}

impl NvmlTelemetry {
    /// Telemetry from an initialised NVML (see `NvmlSource::open`); starts counting XIDs.
    pub fn new(nvml: Nvml) -> Self {
        let nvml = Arc::new(nvml);
        let xids: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let counts = xids.clone();
        let watching = super::xid::watch(nvml.clone(), move |event| {
            if let Some((uuid, _)) = event {
                *counts
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(uuid)
                    .or_default() += 1;
            }
            true
        });
        if let Err(e) = watching {
            tracing::warn!(error = %e, "cannot start the XID watch: XID counts stay 0");
        }
        Self {
            nvml,
            last_seen: Mutex::new(HashMap::new()),
            xids,
        }
    }
}

impl TelemetrySource for NvmlTelemetry {
    fn sample(&self) -> Result<Vec<GpuSample>, String> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| format!("nvmlDeviceGetCount: {e}"))?;
        let mut out = Vec::new();
        for i in 0..count {
            let dev = self
                .nvml
                .device_by_index(i)
                .map_err(|e| format!("nvmlDeviceGetHandleByIndex({i}): {e}"))?;
            let uuid = dev.uuid().map_err(|e| format!("nvmlDeviceGetUUID({i}): {e}"))?;
            let memory = dev.memory_info().ok();
            let healthy = memory.is_some();
            let xid_errors = self
                .xids
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&uuid)
                .copied()
                .unwrap_or(0);
            let model = dev.name().unwrap_or_default();
            let sm_percent = dev.utilization_rates().map(|u| u.gpu).unwrap_or(0);
            let mut processes: HashMap<u32, ProcessSample> = dev
                .running_compute_processes()
                .unwrap_or_default()
                .into_iter()
                .map(|p| {
                    let memory_mib = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => b >> 20,
                        UsedGpuMemory::Unavailable => 0,
                    };
                    (
                        p.pid,
                        ProcessSample {
                            pid: p.pid,
                            memory_mib,
                            sm_percent: 0,
                        },
                    )
                })
                .collect();
            let since = self
                .last_seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&uuid)
                .copied();
            if let Ok(samples) = dev.process_utilization_stats(since) {
                let mut newest = since.unwrap_or(0);
                for s in samples {
                    newest = newest.max(s.timestamp);
                    if let Some(p) = processes.get_mut(&s.pid) {
                        p.sm_percent = p.sm_percent.max(s.sm_util);
                    }
                }
                self.last_seen
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(uuid.clone(), newest);
            }
            let mut processes: Vec<ProcessSample> = processes.into_values().collect();
            processes.sort_by_key(|p| p.pid);
            out.push(GpuSample {
                index: i,
                uuid,
                model,
                memory_total_mib: memory.as_ref().map_or(0, |m| m.total >> 20),
                memory_used_mib: memory.as_ref().map_or(0, |m| m.used >> 20),
                sm_percent,
                healthy,
                xid_errors,
                processes,
            });
        }
        Ok(out)
    }
}
