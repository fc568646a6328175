//! Text for people: aligned tables, sorted by node and GPU index.

use tessera_core::enforcement::ShareEnforcement;

use crate::view::{CardView, ClusterView, NodeView};

/// How `inspect` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// One row per GPU.
    Table,
    /// The table with UUID, NUMA node and health.
    Wide,
    /// The whole view as JSON.
    Json,
}

/// Aligns `rows` under `header` (two spaces between columns, the last column unpadded).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        let mut s = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i == last {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = width[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn compute(c: &CardView) -> String {
    match c.mig {
        Some((used, total)) => format!("MIG {used}/{total}"),
        None => format!("{}/100%", c.core_allocated),
    }
}

fn memory(c: &CardView) -> String {
    match c.mig {
        Some(_) => "-".into(),
        None => format!("{}/{} MiB", c.memory_allocated_mib, c.memory_mib),
    }
}

fn pods(c: &CardView) -> String {
    if c.pods.is_empty() {
        return "-".into();
    }
    c.pods
        .iter()
        .map(|p| format!("{} ({}: {})", p.pod, p.containers.join(","), p.holds))
        .collect::<Vec<_>>()
        .join(", ")
}

fn node_state(n: &NodeView) -> Option<String> {
    n.not_ready
        .as_ref()
        .map(|r| format!("node {}: GPUs not usable: {r}", n.name))
}

/// On a node that holds shares with MPS, the cards a process that goes around the card's MPS
/// daemon can take whole (default compute mode), named.
fn open_around_mps(n: &NodeView) -> Option<String> {
    if n.share_enforcement != ShareEnforcement::Mps.to_string() {
        return None;
    }
    let open: Vec<String> = n
        .cards
        .iter()
        .filter(|c| c.mig.is_none() && c.compute_mode.as_deref() == Some("default"))
        .map(|c| c.index.to_string())
        .collect();
    (!open.is_empty()).then(|| {
        format!(
            "node {}: GPU {} in default compute mode: a process that goes around MPS takes the card whole \
             (the chart's exclusiveProcess: true closes it)",
            n.name,
            open.join(",")
        )
    })
}

/// `kubectl tessera inspect`: one row per GPU of every node in `view`.
pub fn inspect(view: &ClusterView, output: Output) -> String {
    if output == Output::Json {
        return serde_json::to_string_pretty(view).expect("the view serializes") + "\n";
    }
    let wide = output == Output::Wide;
    let mut header = vec!["NODE", "GPU", "MODEL", "COMPUTE", "MEMORY", "TENANT"];
    if wide {
        header.extend(["UUID", "NUMA", "HEALTH", "SHARES", "MODE"]);
    }
    header.push("PODS");
    let mut rows = Vec::new();
    for n in &view.nodes {
        for c in &n.cards {
            let mut r = vec![
                n.name.clone(),
                c.index.to_string(),
                c.model.clone(),
                compute(c),
                memory(c),
                if c.tenants.is_empty() {
                    "-".into()
                } else {
                    c.tenants.join(",")
                },
            ];
            if wide {
                r.extend([
                    c.uuid.clone(),
                    c.numa_node.map_or_else(|| "-".into(), |n| n.to_string()),
                    c.health.clone(),
                    n.share_enforcement.clone(),
                    c.compute_mode.clone().unwrap_or_else(|| "-".into()),
                ]);
            }
            r.push(pods(c));
            rows.push(r);
        }
    }
    let mut out = table(&header, &rows);
    let notes: Vec<String> = view
        .nodes
        .iter()
        .flat_map(|n| node_state(n).into_iter().chain(open_around_mps(n)))
        .chain(view.problems.iter().cloned())
        .collect();
    if !notes.is_empty() {
        out.push('\n');
        for n in notes {
            out.push_str(&format!("! {n}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(index: u32, mode: Option<&str>, mig: bool) -> CardView {
        CardView {
            index,
            uuid: format!("GPU-{index}"),
            model: "NVIDIA H100 80GB HBM3".into(),
            numa_node: None,
            health: "Healthy".into(),
            memory_mib: 81_559,
            core_allocated: 0,
            memory_allocated_mib: 0,
            mig: mig.then_some((0, 7)),
            compute_mode: mode.map(str::to_string),
            pods: Vec::new(),
            tenants: Vec::new(),
        }
    }

    fn node(name: &str, enforcement: ShareEnforcement, cards: Vec<CardView>) -> NodeView {
        NodeView {
            name: name.into(),
            share_enforcement: enforcement.to_string(),
            not_ready: None,
            cards,
        }
    }

    /// An MPS node's cards in default compute mode are named: a process that goes around
    /// their daemon takes them whole. Exclusive cards, cards in MIG mode, cards whose mode is
    /// not published and nodes without MPS are not.
    #[test]
    fn cards_open_around_mps_are_named() {
        let view = ClusterView {
            nodes: vec![
                node(
                    "m1",
                    ShareEnforcement::Mps,
                    vec![
                        card(0, Some("default"), false),
                        card(1, Some("exclusive-process"), false),
                        card(2, Some("default"), false),
                        card(3, Some("default"), true),
                        card(4, None, false),
                    ],
                ),
                node(
                    "m2",
                    ShareEnforcement::Mps,
                    vec![card(0, Some("exclusive-process"), false)],
                ),
                node("h1", ShareEnforcement::Hook, vec![card(0, Some("default"), false)]),
            ],
            problems: Vec::new(),
            unreadable: Vec::new(),
        };
        let out = inspect(&view, Output::Wide);
        let notes: Vec<&str> = out.lines().filter(|l| l.starts_with('!')).collect();
        assert_eq!(
            notes,
            [
                "! node m1: GPU 0,2 in default compute mode: a process that goes around MPS takes the card whole \
                 (the chart's exclusiveProcess: true closes it)"
            ],
            "{out}"
        );
        let header = out.lines().next().unwrap();
        assert!(header.contains(" MODE "), "{header}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("m1") && l.contains(" exclusive-process ")),
            "{out}"
        );
    }
}
