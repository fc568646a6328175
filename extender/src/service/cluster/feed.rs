//! The watch side: Node, Pod and ElasticGPU events write the ledger and the claims.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use k8s_openapi::api::core::v1::{Node, Pod};
use tessera_core::inventory::{Health, PublishedInventory};
use tessera_core::ledger::{Booking, Hold, NodeCapacity};
use tessera_core::names::{
    ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE, ANNOTATION_INVENTORY, LABEL_CROSS_TENANT_SHARING,
    LABEL_DRA, offers_dra,
};
use tessera_core::placement::PodDemand;
use tessera_core::quantity::Amount;
use tracing::{debug, warn};

use super::Cluster;
use tessera_claims::holds::is_booking_key;

/// Reads a node: its capacity, and why its GPUs cannot be given to pods (the node publishes
/// its driver as not ready, or gives its GPUs to DRA claims), when they cannot.
pub(super) fn node_capacity(node: &Node) -> (NodeCapacity, Option<String>) {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let alloc = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let amount = |key: &str| {
        alloc.and_then(|a| a.get(key)).and_then(|q| match Amount::parse(&q.0) {
            Ok(a) => Some(a),
            Err(e) => {
                warn!(node = name, resource = key, value = q.0, error = %e, "unparsable allocatable");
                None
            }
        })
    };
    let (gpus, not_ready, share_enforcement, topology) = match node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_INVENTORY))
    {
        None => (Vec::new(), None, Default::default(), None),
        Some(v) => match PublishedInventory::decode(v) {
            Ok(inv) => {
                // A matrix that does not match the GPUs would misplace; place without it.
                let topology = inv.topology.filter(|t| {
                    let fits = t.len() == inv.gpus.len();
                    if !fits {
                        warn!(
                            node = name,
                            rows = t.len(),
                            gpus = inv.gpus.len(),
                            "ignoring a GPU topology that does not match the GPUs"
                        );
                    }
                    fits
                });
                (
                    inv.gpus,
                    inv.not_ready,
                    inv.share_enforcement,
                    topology.map(std::sync::Arc::new),
                )
            }
            Err(e) => {
                warn!(node = name, error = %e, "ignoring the node's {ANNOTATION_INVENTORY} annotation");
                (Vec::new(), None, Default::default(), None)
            }
        },
    };
    let not_ready = not_ready.map(|reason| format!("the node's GPU driver is not ready: {reason}"));
    // A node that serves DRA claims: its cards are the DRA scheduler's to give.
    let not_ready = not_ready.or_else(|| {
        offers_dra(node.metadata.labels.as_ref())
            .then(|| format!("the node's GPUs go to DRA claims ({LABEL_DRA}=true): ask with a ResourceClaim"))
    });
    // A node whose driver cannot serve containers, or whose GPUs go to DRA, keeps its GPUs in
    // the books (bound pods stay counted) but offers none.
    let gpus = match &not_ready {
        None => gpus,
        Some(reason) => gpus
            .into_iter()
            .map(|mut g| {
                g.health = Health::Unhealthy { reason: reason.clone() };
                g
            })
            .collect(),
    };
    let cap = NodeCapacity {
        cpu_milli: amount("cpu").map_or(0, Amount::milli_ceil),
        memory_bytes: amount("memory").map_or(0, Amount::ceil),
        gpus,
        schedulable: !node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false),
        share_enforcement,
        topology,
        cross_tenant: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_CROSS_TENANT_SHARING))
            .is_some_and(|v| v == "true"),
    };
    (cap, not_ready)
}

fn is_terminated(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

impl Cluster {
    /// An ElasticGPU was added or changed.
    pub fn elastic_gpu_applied(&self, e: &tessera_api::egpu::ElasticGpu) {
        let mut l = self.ledger();
        let change = self.claims().gpu_applied(e);
        Self::apply(&mut l, change);
    }

    /// An ElasticGPU was deleted.
    pub fn elastic_gpu_deleted(&self, name: &str) {
        let mut l = self.ledger();
        let change = self.claims().gpu_deleted(name);
        Self::apply(&mut l, change);
    }

    /// A full ElasticGPU list was read.
    pub fn elastic_gpus_listed(&self, names: &HashSet<String>) {
        let mut l = self.ledger();
        let change = self.claims().gpus_listed(names);
        Self::apply(&mut l, change);
        self.elastic_gpus_synced.store(true, Ordering::Release);
    }

    /// A node was added or changed.
    pub fn node_applied(&self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let (cap, not_ready) = node_capacity(node);
        let changed = self.not_ready().set(name, not_ready.clone());
        if changed && let Some(reason) = &not_ready {
            warn!(node = name, reason, "no GPU pods go to the node");
        }
        for (uid, e) in self.ledger().set_node(name, cap) {
            warn!(node = name, pod_uid = uid, error = %e, "a booked allocation no longer matches the node");
        }
    }

    /// A node was deleted.
    pub fn node_deleted(&self, name: &str) {
        self.ledger().remove_node(name);
        self.not_ready().set(name, None);
    }

    /// A full node list was read: nodes not in it are gone.
    pub fn nodes_listed(&self, names: &HashSet<String>) {
        let mut l = self.ledger();
        let known: Vec<String> = l.cluster().nodes.iter().map(|n| n.name.clone()).collect();
        for n in known.iter().filter(|n| !names.contains(*n)) {
            l.remove_node(n);
        }
        self.not_ready().retain(|n| names.contains(n));
        self.nodes_synced.store(true, Ordering::Release);
    }

    /// A pod was added or changed: bound pods are booked with their verified allocation,
    /// finished pods free what they held.
    pub fn pod_applied(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        if is_terminated(pod) {
            let mut l = self.ledger();
            l.unbook(uid);
            let change = self.claims().release_pod(uid);
            Self::apply(&mut l, change);
            return;
        }
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            // Not bound: a reservation of ours (bind in flight) stays as it is.
            return;
        };
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let annotations = pod.metadata.annotations.as_ref();
        let allocation = annotations
            .and_then(|a| a.get(ANNOTATION_ALLOCATION))
            .and_then(|value| {
                let sig = annotations.and_then(|a| a.get(ANNOTATION_ALLOCATION_SIGNATURE));
                match self.keys().verify(Some(value), sig.map(String::as_str), node, uid) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        warn!(pod = name, node, error = %e, "not counting an allocation that does not verify");
                        None
                    }
                }
            });
        let (demand, claims, pod_key) = match self.ask(pod) {
            Ok(a) => (a.demand, a.claims, a.pod),
            Err(e) => {
                debug!(pod = name, error = %e, "bound pod with an invalid request: counting nothing");
                (PodDemand::default(), Vec::new(), String::new())
            }
        };
        let mut l = self.ledger();
        // The first verified allocation of a pod holds until the pod ends: its node injected
        // those devices at sandbox creation, whatever the annotation says now (a tenant may
        // rewrite its own pod's annotations; pods/update allows it).
        let allocation = allocation.or_else(|| {
            let kept = l.booking(uid).filter(|b| b.node == node)?.allocation.clone()?;
            warn!(
                pod = name,
                node, "the pod's allocation annotation no longer verifies: keeping the allocation it was bound with"
            );
            Some(kept)
        });
        if !claims.is_empty() {
            let change = self
                .claims()
                .use_claims(uid, &pod_key, claims.into_iter().map(|(_, k)| k).collect());
            Self::apply(&mut l, change);
        }
        if allocation.is_none() && !demand.wants_cards() {
            // Most pods: only their CPU and memory count, kept in a few bytes.
            l.book_plain(uid, node, demand.cpu_milli, demand.memory_bytes);
            return;
        }
        if let Some(b) = l.booking(uid)
            && b.node == node
            && b.allocation == allocation
            && b.demand == demand
        {
            l.confirm(uid);
            return;
        }
        // Running GPU pods are the workload fragmentation is measured against.
        let learn = allocation.is_some() && l.booking(uid).is_none();
        let booking = Booking {
            node: node.to_string(),
            demand,
            allocation,
            hold: Hold::Bound,
        };
        if learn {
            self.learn(&mut l, &booking.demand);
        }
        if let Err(e) = l.book(uid, booking.clone()) {
            warn!(pod = name, node, error = %e, "counting the pod without its GPUs");
            let _ = l.book(
                uid,
                Booking {
                    allocation: None,
                    ..booking
                },
            );
        }
    }

    /// A pod was deleted.
    pub fn pod_deleted(&self, uid: &str) {
        let mut l = self.ledger();
        l.unbook(uid);
        let change = self.claims().release_pod(uid);
        Self::apply(&mut l, change);
    }

    /// A full pod list was read: bound bookings of pods not in it are gone (our own
    /// reservations in flight stay).
    pub fn pods_listed(&self, uids: &HashSet<String>) {
        let mut l = self.ledger();
        for uid in l.booked_uids() {
            // Retained ElasticGPUs are booked under their own keys, not pods'.
            if is_booking_key(&uid) {
                continue;
            }
            if !uids.contains(&uid) && l.booking(&uid).is_some_and(|b| b.hold == Hold::Bound) {
                l.unbook(&uid);
            }
        }
        l.retain_plain(uids);
        let change = self.claims().pods_listed(uids);
        Self::apply(&mut l, change);
        self.pods_synced.store(true, Ordering::Release);
        // The running pods seen during the list are the first target workload.
        let mut learning = self.learning.lock().unwrap_or_else(|p| p.into_inner());
        if learning.stale || learning.seen > 0 {
            learning.stale = false;
            l.set_workload(&learning.learner.target(0.95, 10));
        }
    }
}
