//! Text for people: aligned tables, sorted by node and GPU index.

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

/// `kubectl tessera inspect`: one row per GPU of every node in `view`.
pub fn inspect(view: &ClusterView, output: Output) -> String {
    if output == Output::Json {
        return serde_json::to_string_pretty(view).expect("the view serializes") + "\n";
    }
    let wide = output == Output::Wide;
    let mut header = vec!["NODE", "GPU", "MODEL", "COMPUTE", "MEMORY", "TENANT"];
    if wide {
        header.extend(["UUID", "NUMA", "HEALTH", "SHARES"]);
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
        .filter_map(node_state)
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
