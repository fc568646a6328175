//! The GPUs' link topology and CPU affinity from NVML, as `nvidia-smi topo -m` derives them:
//! per pair, the NVLinks whose far end is the other GPU, else (both GPUs on NVSwitches) the
//! links each has to a switch, else the closest common PCIe ancestor.

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;

use tessera_core::topology::{GpuTopology, Link};

/// NVML's `NVML_NVLINK_MAX_LINKS`.
const MAX_NVLINKS: u32 = 18;
/// Words of the CPU mask asked for (64 CPUs each: up to 4096 CPUs).
const AFFINITY_WORDS: usize = 64;

/// A PCI bus id without its domain's leading zeros (NVML writes `00000000:18:00.0` in some
/// calls and `0000:18:00.0` in others).
pub(crate) fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) => {
            let d = u32::from_str_radix(domain, 16).unwrap_or(0);
            format!("{d:04x}:{rest}")
        }
        None => id,
    }
}

/// The Linux CPU list (`0-31,64-95`) of a CPU bit mask (64 CPUs per word, lowest first).
pub(crate) fn cpu_list(mask: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut run: Option<(usize, usize)> = None;
    let bits = mask
        .iter()
        .enumerate()
        .flat_map(|(w, word)| (0..64).filter(move |b| word >> b & 1 == 1).map(move |b| w * 64 + b));
    for cpu in bits {
        run = match run {
            Some((start, end)) if end + 1 == cpu => Some((start, cpu)),
            Some(r) => {
                out.push(range(r));
                Some((cpu, cpu))
            }
            None => Some((cpu, cpu)),
        };
    }
    out.extend(run.map(range));
    out.join(",")
}

fn range((a, b): (usize, usize)) -> String {
    if a == b { a.to_string() } else { format!("{a}-{b}") }
}

/// The CPUs close to GPU `index`, when NVML says.
pub(crate) fn cpu_affinity(nvml: &Nvml, index: u32) -> Option<String> {
    let dev = nvml.device_by_index(index).ok()?;
    // c_ulong is 64 bits on the Linux targets NVML supports.
    let mask: Vec<u64> = dev.cpu_affinity(AFFINITY_WORDS).ok()?;
    let list = cpu_list(&mask);
    (!list.is_empty()).then_some(list)
}

/// The link matrix of the GPUs whose bus ids are `bus_ids` (in index order); `None` when NVML
/// cannot tell the PCIe path of some pair (no partial matrix is published).
pub(crate) fn discover(nvml: &Nvml, bus_ids: &[String]) -> Option<GpuTopology> {
    let n = bus_ids.len();
    let buses: Vec<String> = bus_ids.iter().map(|b| normalize_bus_id(b)).collect();
    let mut direct = vec![0u8; n * n];
    let mut to_switch = vec![0u8; n];
    for i in 0..n {
        let dev = nvml.device_by_index(i as u32).ok()?;
        for l in 0..MAX_NVLINKS {
            let link = dev.link_wrapper_for(l);
            match link.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // No NVLink on this GPU (or no such link).
                Err(_) => break,
            }
            let Ok(remote) = link.remote_pci_info() else { continue };
            match buses.iter().position(|b| *b == normalize_bus_id(&remote.bus_id)) {
                Some(j) if j != i => direct[i * n + j] = direct[i * n + j].saturating_add(1),
                Some(_) => {}
                // Not a GPU of this node: an NVSwitch.
                None => to_switch[i] = to_switch[i].saturating_add(1),
            }
        }
    }
    let mut failed = false;
    let topology = GpuTopology::new(n, |a, b| {
        let nv = direct[a * n + b].max(direct[b * n + a]);
        if nv > 0 {
            return Link::NvLink(nv);
        }
        if to_switch[a] > 0 && to_switch[b] > 0 {
            return Link::NvLink(to_switch[a].min(to_switch[b]));
        }
        let level = nvml
            .device_by_index(a as u32)
            .and_then(|da| nvml.device_by_index(b as u32).map(|db| (da, db)))
            .and_then(|(da, db)| da.topology_common_ancestor(db));
        match level {
            Ok(TopologyLevel::Internal | TopologyLevel::Single) => Link::Pix,
            Ok(TopologyLevel::Multiple) => Link::Pxb,
            Ok(TopologyLevel::HostBridge) => Link::Phb,
            Ok(TopologyLevel::Node) => Link::Node,
            Ok(TopologyLevel::System) => Link::Sys,
            Err(_) => {
                failed = true;
                Link::Sys
            }
        }
    })
    .ok()?;
    (!failed).then_some(topology)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_and_cpu_lists() {
        assert_eq!(normalize_bus_id("00000000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(normalize_bus_id("0000:1b:00.0"), "0000:1b:00.0");
        assert_eq!(cpu_list(&[0xffff_ffff, 0xffff_ffff]), "0-31,64-95");
        assert_eq!(cpu_list(&[0b1011]), "0-1,3");
        assert_eq!(cpu_list(&[1 << 63, 1]), "63-64");
        assert_eq!(cpu_list(&[0, 0]), "");
    }
}
