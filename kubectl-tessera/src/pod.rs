//! `kubectl tessera pod POD`: what the pod asked for, what it was given (checked against its
//! node's inventory) and on which card, and the story its events tell (the scheduler's reasons
//! while it is pending).

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::request::{GpuDemand, PodRequest, RequestOptions};

use crate::view::{ClusterView, allocation_of, holds, pod_key};

/// Events shown, the latest.
pub const EVENTS_SHOWN: usize = 10;

fn asked(d: &GpuDemand) -> String {
    match d {
        GpuDemand::None => "no GPU".into(),
        GpuDemand::Share(s) => match s.memory_mib {
            Some(m) => format!("{}% + {m} MiB of one GPU", s.core_percent),
            None => format!("{}% of one GPU (memory in proportion)", s.core_percent),
        },
        GpuDemand::Whole { cards, min_memory_mib } => format!(
            "{cards} whole GPU(s){}",
            min_memory_mib.map_or_else(String::new, |m| format!(", {m} MiB each at least"))
        ),
        GpuDemand::Mig(m) => m
            .iter()
            .map(|d| format!("MIG {} x{}", d.profile, d.count))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

fn when(e: &Event) -> String {
    e.last_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .or_else(|| e.event_time.as_ref().map(|t| t.0.to_string()))
        .unwrap_or_default()
}

/// The report for `pod`, with the cluster's `nodes` and the pod's `events`.
pub fn report(pod: &Pod, nodes: &[Node], events: &[Event], opts: &RequestOptions) -> String {
    let mut out = String::new();
    let key = pod_key(pod);
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_else(|| "Pending".into());
    let _ = writeln!(out, "Pod:    {key}");
    let _ = writeln!(out, "Node:   {}", node.as_deref().unwrap_or("(not bound)"));
    let _ = writeln!(out, "Phase:  {phase}");
    out.push_str("Asked:\n");
    match PodRequest::from_pod(pod, opts) {
        Ok(r) => {
            for c in &r.containers {
                let _ = writeln!(out, "  {}: {}", c.name, asked(&c.gpu));
            }
            if let Some(link) = r.gpu_link {
                let _ = writeln!(out, "  (whole GPUs connected: {link})");
            }
        }
        Err(e) => {
            let _ = writeln!(out, "  invalid request: {e}");
        }
    }
    out.push_str("Given:\n");
    match allocation_of(pod) {
        None => out.push_str("  nothing yet\n"),
        Some(Err(e)) => {
            let _ = writeln!(out, "  unreadable allocation: {e}");
        }
        Some(Ok(a)) => {
            let view = ClusterView::build(nodes, std::slice::from_ref(pod));
            let cards = view.nodes.iter().find(|n| n.name == a.node).map(|n| &n.cards);
            for c in &a.containers {
                for d in &c.devices {
                    let card = cards.and_then(|cs| cs.iter().find(|x| x.uuid == d.card_uuid()));
                    let on = match card {
                        Some(card) => format!("GPU {} {} ({})", card.index, card.uuid, card.model),
                        None => format!("{} (not on {}'s inventory)", d.card_uuid(), a.node),
                    };
                    let what = match d {
                        AllocatedDevice::Mig { uuid, .. } => format!("{}, {uuid}", holds(d)),
                        _ => holds(d),
                    };
                    let _ = writeln!(out, "  {}: {what} on {on}", c.name);
                }
            }
            let _ = writeln!(
                out,
                "Check:  {}",
                if view.problems.is_empty() {
                    format!("every device is on {}'s inventory", a.node)
                } else {
                    view.problems.join("; ")
                }
            );
        }
    }
    let mut mine: Vec<&Event> = events
        .iter()
        .filter(|e| {
            e.involved_object.uid == pod.metadata.uid
                || (e.involved_object.uid.is_none() && e.involved_object.name == pod.metadata.name)
        })
        .collect();
    mine.sort_by_key(|e| when(e));
    if !mine.is_empty() {
        out.push_str("Events:\n");
        for e in mine.iter().rev().take(EVENTS_SHOWN).rev() {
            let _ = writeln!(
                out,
                "  {:<8} {:<18} {}",
                e.type_.as_deref().unwrap_or("Normal"),
                e.reason.as_deref().unwrap_or_default(),
                e.message.as_deref().unwrap_or_default()
            );
        }
    } else if node.is_none() {
        out.push_str("Events: none (is the pod's schedulerName tessera, and the scheduler running?)\n");
    }
    out
}
