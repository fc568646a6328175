//! `tessera-cdi-generator topology`: the GPUs' link matrix as `nvidia-smi topo -m` prints it,
//! with each GPU's CPU and NUMA affinity, from the same inventory the node publishes.

use std::fmt::Write as _;

use tessera_core::inventory::NodeInventory;

const LEGEND: &str = "\
Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
";

/// The matrix, aligned, then where it came from and the legend.
pub fn text(inv: &NodeInventory) -> String {
    let n = inv.gpus.len();
    if n == 0 {
        return "no GPU\n".into();
    }
    let cell = |a: usize, b: usize| {
        if a == b {
            "X".to_string()
        } else {
            inv.link(a, b).map_or_else(|| "?".to_string(), |l| l.to_string())
        }
    };
    let width = (0..n)
        .flat_map(|a| (0..n).map(move |b| (a, b)))
        .map(|(a, b)| cell(a, b).len())
        .chain((0..n).map(|i| format!("GPU{}", inv.gpus[i].index).len()))
        .max()
        .unwrap_or(1)
        + 2;
    let affinity_width = inv
        .gpus
        .iter()
        .map(|g| g.cpu_affinity.as_deref().unwrap_or("N/A").len())
        .max()
        .unwrap_or(0)
        .max("CPU Affinity".len())
        + 2;
    let mut out = format!("{:width$}", "");
    for g in &inv.gpus {
        let _ = write!(out, "{:width$}", format!("GPU{}", g.index));
    }
    let _ = writeln!(out, "{:affinity_width$}NUMA Affinity", "CPU Affinity");
    for (a, g) in inv.gpus.iter().enumerate() {
        let _ = write!(out, "{:width$}", format!("GPU{}", g.index));
        for b in 0..n {
            let _ = write!(out, "{:width$}", cell(a, b));
        }
        let numa = g.numa_node.map_or_else(|| "N/A".to_string(), |n| n.to_string());
        let _ = writeln!(
            out,
            "{:affinity_width$}{numa}",
            g.cpu_affinity.as_deref().unwrap_or("N/A")
        );
    }
    out.push('\n');
    out.push_str(match (&inv.topology, inv.gpus.iter().any(|g| g.numa_node.is_some())) {
        (Some(_), _) => "Links: from NVML (published with the node's inventory).\n",
        (None, true) => "Links: no link matrix; NODE and SYS from the GPUs' NUMA nodes only.\n",
        (None, false) => "Links: unknown (no link matrix, no NUMA nodes); every set is equal to the scheduler.\n",
    });
    out.push('\n');
    out.push_str(LEGEND);
    out
}

/// The published topology and affinities, as JSON.
pub fn json(inv: &NodeInventory) -> serde_json::Value {
    serde_json::json!({
        "topology": inv.topology,
        "gpus": inv.gpus.iter().map(|g| serde_json::json!({
            "index": g.index,
            "uuid": g.uuid,
            "pci_bus_id": g.pci_bus_id,
            "numa_node": g.numa_node,
            "cpu_affinity": g.cpu_affinity,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use tessera_core::inventory::{FixtureSource, InventorySource};

    use super::*;

    fn inv(name: &str) -> NodeInventory {
        FixtureSource::new(name).discover().unwrap()
    }

    #[test]
    fn prints_the_matrix_like_nvidia_smi() {
        let text = text(&inv("l40s-pcie-switches"));
        // (The header starts with spaces, so the literal cannot start with a line continuation.)
        let expected = "      GPU0  GPU1  GPU2  GPU3  CPU Affinity  NUMA Affinity
GPU0  X     PIX   PHB   PHB   0-47          0
GPU1  PIX   X     PHB   PHB   0-47          0
GPU2  PHB   PHB   X     PIX   0-47          0
GPU3  PHB   PHB   PIX   X     0-47          0

Links: from NVML (published with the node's inventory).
";
        assert!(text.starts_with(expected), "{text}");
        assert!(text.ends_with(LEGEND));
        let pairs = super::text(&inv("a100-nvlink-pairs"));
        assert!(
            pairs.contains("GPU0  X     NV12  NODE  NODE  SYS   SYS   SYS   SYS   0-31,64-95    0\n"),
            "{pairs}"
        );
    }

    #[test]
    fn says_where_links_come_from() {
        let numa_only = text(&inv("h100x8"));
        assert!(numa_only.contains("GPU0  X     NODE  NODE  NODE  SYS"), "{numa_only}");
        assert!(numa_only.contains("NUMA nodes only"));
        let mut bare = inv("t4x2");
        bare.gpus.iter_mut().for_each(|g| g.numa_node = None);
        let t = text(&bare);
        assert!(t.contains("GPU0  X     ?     N/A"), "{t}");
        assert!(t.contains("Links: unknown"));
        let j = json(&inv("h100-nvswitch"));
        assert_eq!(j["topology"]["version"], 1);
        assert_eq!(j["topology"]["matrix"][0], "X NV18 NV18 NV18 NV18 NV18 NV18 NV18");
        assert_eq!(j["gpus"][4]["cpu_affinity"], "56-111,168-223");
    }
}
