use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tessera_core::enforcement::ShareEnforcement;
use tessera_core::handoff::AllocatedDevice;
use tessera_node::memory_limits::{CgroupMemoryLimits, Limits, MemoryLimitError};

use crate::plugin::TesseraPlugin;
use crate::plugin::tests::Node;

/// The driver's per-cgroup limits as NVML keeps them, in memory; `skew` bytes are added to
/// what it reads back (a driver that did not take the limit as asked).
#[derive(Default)]
struct Driver {
    limits: Mutex<HashMap<(String, PathBuf), (u64, u64)>>,
    skew: u64,
}

impl CgroupMemoryLimits for Driver {
    fn set(&self, uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), MemoryLimitError> {
        let mut limits = self.limits.lock().unwrap();
        let key = (uuid.to_string(), cgroup.to_path_buf());
        if soft == 0 && hard == u64::MAX {
            limits.remove(&key);
        } else {
            limits.insert(key, (soft, hard));
        }
        Ok(())
    }

    fn get(&self, uuid: &str, cgroup: &Path) -> Result<Option<Limits>, MemoryLimitError> {
        let limits = self.limits.lock().unwrap();
        Ok(limits
            .get(&(uuid.to_string(), cgroup.to_path_buf()))
            .map(|&(soft, hard)| Limits {
                soft,
                hard: hard + self.skew,
                used: 0,
            }))
    }
}

/// A plugin of `node` holding memory per cgroup through `driver`, with the host's cgroup
/// hierarchy under the node's directory.
fn per_cgroup_plugin(node: &Node, driver: Arc<Driver>) -> TesseraPlugin {
    node.plugin(ShareEnforcement::Mps)
        .holding_memory_per_cgroup(driver, node.dir.path().join("cgroup"))
}

/// Process `pid` in cgroup `/kubepods/<name>` (which exists), as the host's /proc shows it.
fn process(node: &Node, pid: u32, name: &str) -> PathBuf {
    let cgroup = node.dir.path().join("cgroup/kubepods").join(name);
    std::fs::create_dir_all(&cgroup).unwrap();
    let dir = node.proc_root().join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup"), format!("0::/kubepods/{name}\n")).unwrap();
    std::fs::write(dir.join("status"), "Name:\tpython\nUid:\t0\t0\t0\t0\n").unwrap();
    cgroup
}

/// A share's memory is set on its container's cgroup when it starts, from the signed
/// allocation (hard and soft: the share), noted in its grant record, and cleared when it
/// stops; a whole card's container gets none. Fails without the limit at StartContainer.
#[tokio::test]
async fn a_shares_memory_is_set_on_its_cgroup_at_start_and_cleared_at_stop() {
    let node = Node::new();
    node.daemons_hold_the_wanted_ceilings();
    let driver = Arc::new(Driver::default());
    let plugin = per_cgroup_plugin(&node, driver.clone());
    let card = &node.inv.gpus[1];
    let (pod, mut ctr) = node.signed("share", AllocatedDevice::share(card, 30, 4096), &[]);
    plugin.adjust(&pod, &ctr).unwrap();
    node.daemons_hold_the_wanted_ceilings();
    let cgroup = process(&node, 201, "share");
    ctr.pid = 201;
    plugin.start(&pod, &ctr).unwrap();
    let set = driver.limits.lock().unwrap().clone();
    assert_eq!(
        set,
        HashMap::from([((card.uuid.clone(), cgroup.clone()), (4096 << 20, 4096 << 20))])
    );
    let held = plugin.tracked()["ctr-share"].cgroup_memory.clone().unwrap();
    assert_eq!(held.cgroup.as_deref(), Some(cgroup.as_path()));
    plugin.stopped("ctr-share");
    assert!(
        driver.limits.lock().unwrap().is_empty(),
        "a stopped share's limit stays"
    );

    let (pod, mut ctr) = node.signed("whole", AllocatedDevice::whole(&node.inv.gpus[3]), &[]);
    plugin.adjust(&pod, &ctr).unwrap();
    process(&node, 202, "whole");
    ctr.pid = 202;
    plugin.start(&pod, &ctr).unwrap();
    assert!(driver.limits.lock().unwrap().is_empty(), "a whole card was limited");

    // A node that runs shares unenforced (and annotates them so) sets no limit either.
    let unenforced = node
        .plugin(ShareEnforcement::None)
        .holding_memory_per_cgroup(driver.clone(), node.dir.path().join("cgroup"));
    let (pod, mut ctr) = node.signed("labelled", AllocatedDevice::share(&node.inv.gpus[4], 30, 4096), &[]);
    unenforced.adjust(&pod, &ctr).unwrap();
    process(&node, 203, "labelled");
    ctr.pid = 203;
    unenforced.start(&pod, &ctr).unwrap();
    assert!(
        driver.limits.lock().unwrap().is_empty(),
        "an unenforced share was limited"
    );
}

/// A share whose limit cannot be set, or does not read back as set, does not start: the
/// refusal names the container, its memory and card, and why; nothing is left set.
#[tokio::test]
async fn a_share_whose_limit_does_not_hold_is_refused_at_start() {
    let node = Node::new();
    node.daemons_hold_the_wanted_ceilings();
    let card = &node.inv.gpus[2];
    let lying = Arc::new(Driver {
        skew: 1 << 20,
        ..Default::default()
    });
    let plugin = per_cgroup_plugin(&node, lying.clone());
    let (pod, mut ctr) = node.signed("lied", AllocatedDevice::share(card, 30, 4096), &[]);
    plugin.adjust(&pod, &ctr).unwrap();
    node.daemons_hold_the_wanted_ceilings();
    process(&node, 301, "lied");
    ctr.pid = 301;
    let err = plugin.limit_memory(&ctr).unwrap_err().to_string();
    assert!(
        err.contains("\"c\"") && err.contains("4096 MiB") && err.contains(&card.uuid) && err.contains("reads back"),
        "{err}"
    );
    assert!(lying.limits.lock().unwrap().is_empty(), "a refused share's limit stays");

    let driver = Arc::new(Driver::default());
    let plugin = per_cgroup_plugin(&node, driver.clone());
    let (pod, mut ctr) = node.signed("nowhere", AllocatedDevice::share(card, 30, 4096), &[]);
    plugin.adjust(&pod, &ctr).unwrap();
    node.daemons_hold_the_wanted_ceilings();
    ctr.pid = 0; // no pid given, and no process of the container's under /proc
    let err = plugin.limit_memory(&ctr).unwrap_err().to_string();
    assert!(err.contains("process is not found"), "{err}");
    let dir = node.proc_root().join("302");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cgroup"), "0::/kubepods/removed\n").unwrap();
    ctr.pid = 302;
    let err = plugin.limit_memory(&ctr).unwrap_err().to_string();
    assert!(err.contains("removed does not exist"), "{err}");
    assert!(driver.limits.lock().unwrap().is_empty());
}
