//! The Alibaba GPU trace (cluster-trace-gpu-v2023, "openb") CSV files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tessera_core::placement::{CARD_MILLI, CardDemand, CardState, ClusterState, NodeState, PodDemand};

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A missing column.
    #[error("{path}: no column {column:?} in the header")]
    Column { path: PathBuf, column: &'static str },
    /// A value that does not parse.
    #[error("{path}:{line}: column {column}={value:?} is not a valid {what}")]
    Value {
        path: PathBuf,
        line: usize,
        column: &'static str,
        value: String,
        what: &'static str,
    },
    /// A task the engine cannot express.
    #[error("{path}:{line}: {reason}")]
    Task { path: PathBuf, line: usize, reason: String },
}

/// One trace node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceNode {
    /// `sn`.
    pub name: String,
    /// CPU, millicores.
    pub cpu_milli: u64,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// GPUs.
    pub gpus: u32,
    /// GPU model (`P100`, `T4`, `V100M16`, `G2`, ...).
    pub model: String,
}

/// One trace task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceTask {
    /// Task name.
    pub name: String,
    /// CPU, millicores.
    pub cpu_milli: u64,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Whole GPUs (or 1 for a share).
    pub num_gpu: u32,
    /// Compute per GPU, milli (below 1000 only for shares).
    pub gpu_milli: u32,
    /// Allowed models, `|`-separated (empty = any).
    pub gpu_spec: String,
}

impl TraceTask {
    /// The task as the placement engine sees it.
    pub fn demand(&self) -> PodDemand {
        let cards = match (self.num_gpu, self.gpu_milli) {
            (0, _) | (_, 0) => None,
            (1, m) if m < CARD_MILLI => Some(CardDemand::Share {
                core_milli: m,
                memory_mib: None,
            }),
            (n, _) => Some(CardDemand::Whole {
                cards: n,
                min_memory_mib: None,
            }),
        };
        let mut pod = PodDemand::single(self.cpu_milli, self.memory_mib << 20, cards);
        if !self.gpu_spec.is_empty() {
            pod.gpu_models = Some(self.gpu_spec.split('|').map(str::to_string).collect());
        }
        pod
    }
}

/// GPU memory per trace model, MiB (shares take memory in proportion to compute, so this only
/// matters for reporting).
fn model_memory_mib(model: &str) -> u64 {
    match model {
        "T4" => 15_109,
        "P100" => 16_280,
        "V100M16" => 16_160,
        "V100M32" => 32_510,
        "A10" => 22_731,
        _ => 16_384,
    }
}

struct Csv {
    path: PathBuf,
    columns: HashMap<String, usize>,
    rows: Vec<(usize, Vec<String>)>,
}

impl Csv {
    fn read(path: &Path) -> Result<Self, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Read {
            path: path.into(),
            source,
        })?;
        Ok(Self::parse(&text, path))
    }

    fn parse(text: &str, path: &Path) -> Self {
        let mut lines = text.lines().enumerate();
        let header = lines.next().map(|(_, h)| h).unwrap_or_default();
        let columns = header
            .split(',')
            .enumerate()
            .map(|(i, c)| (c.trim().to_string(), i))
            .collect();
        let rows = lines
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(n, l)| (n + 1, l.split(',').map(|f| f.trim().to_string()).collect()))
            .collect();
        Self {
            path: path.into(),
            columns,
            rows,
        }
    }

    fn col(&self, name: &'static str) -> Result<usize, TraceError> {
        self.columns.get(name).copied().ok_or(TraceError::Column {
            path: self.path.clone(),
            column: name,
        })
    }

    fn num<T: std::str::FromStr>(
        &self,
        row: &(usize, Vec<String>),
        col: usize,
        name: &'static str,
    ) -> Result<T, TraceError> {
        let v = row.1.get(col).map(String::as_str).unwrap_or("");
        v.parse().map_err(|_| TraceError::Value {
            path: self.path.clone(),
            line: row.0,
            column: name,
            value: v.to_string(),
            what: "number",
        })
    }
}

/// Reads an openb node list.
pub fn read_nodes(path: &Path) -> Result<Vec<TraceNode>, TraceError> {
    parse_nodes(&Csv::read(path)?)
}

fn parse_nodes(csv: &Csv) -> Result<Vec<TraceNode>, TraceError> {
    let (sn, cpu, mem, gpu, model) = (
        csv.col("sn")?,
        csv.col("cpu_milli")?,
        csv.col("memory_mib")?,
        csv.col("gpu")?,
        csv.col("model")?,
    );
    csv.rows
        .iter()
        .map(|r| {
            Ok(TraceNode {
                name: r.1.get(sn).cloned().unwrap_or_default(),
                cpu_milli: csv.num(r, cpu, "cpu_milli")?,
                memory_mib: csv.num(r, mem, "memory_mib")?,
                gpus: csv.num(r, gpu, "gpu")?,
                model: r.1.get(model).cloned().unwrap_or_default(),
            })
        })
        .collect()
}

/// Reads an openb pod list.
pub fn read_tasks(path: &Path) -> Result<Vec<TraceTask>, TraceError> {
    parse_tasks(&Csv::read(path)?)
}

fn parse_tasks(csv: &Csv) -> Result<Vec<TraceTask>, TraceError> {
    let (name, cpu, mem, num, milli) = (
        csv.col("name")?,
        csv.col("cpu_milli")?,
        csv.col("memory_mib")?,
        csv.col("num_gpu")?,
        csv.col("gpu_milli")?,
    );
    let spec = csv.columns.get("gpu_spec").copied();
    csv.rows
        .iter()
        .map(|r| {
            let t = TraceTask {
                name: r.1.get(name).cloned().unwrap_or_default(),
                cpu_milli: csv.num(r, cpu, "cpu_milli")?,
                memory_mib: csv.num(r, mem, "memory_mib")?,
                num_gpu: csv.num(r, num, "num_gpu")?,
                gpu_milli: csv.num(r, milli, "gpu_milli")?,
                gpu_spec: spec.and_then(|c| r.1.get(c).cloned()).unwrap_or_default(),
            };
            if t.gpu_milli > CARD_MILLI || (t.num_gpu > 1 && t.gpu_milli < CARD_MILLI && t.gpu_milli > 0) {
                return Err(TraceError::Task {
                    path: csv.path.clone(),
                    line: r.0,
                    reason: format!(
                        "task {} asks for {} GPU(s) x {} milli; shares (below 1000) are for one GPU only",
                        t.name, t.num_gpu, t.gpu_milli
                    ),
                });
            }
            Ok(t)
        })
        .collect()
}

/// The engine's cluster for a node list (each node's cards share its model).
pub fn cluster_of(nodes: &[TraceNode]) -> ClusterState {
    let mut cluster = ClusterState::new();
    for n in nodes {
        let model = cluster.model_id(&n.model);
        let cards = (0..n.gpus)
            .map(|i| CardState {
                uuid: format!("{}-gpu{i}", n.name),
                index: i,
                minor: i,
                model,
                memory_mib: model_memory_mib(&n.model),
                numa: None,
                healthy: true,
                core_used: 0,
                memory_used: 0,
                mig: None,
                share_user: None,
            })
            .collect();
        cluster.add_node(NodeState {
            name: n.name.clone(),
            cpu_milli: n.cpu_milli,
            cpu_used: 0,
            memory_bytes: n.memory_mib << 20,
            memory_used: 0,
            cards,
            schedulable: true,
            enforcement: Default::default(),
            cross_tenant: false,
            topology: None,
        });
    }
    cluster
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_pod_list_layouts() {
        let full = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
                    p0,12000,16384,1,1000,,LS,Running,0,1,0\n\
                    p1,6000,12288,1,460,T4|P100,LS,Running,0,1,0\n\
                    p2,4000,8192,0,0,,BE,Running,0,1,0\n";
        let t = parse_tasks(&Csv::parse(full, Path::new("pods.csv"))).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(
            t[1].demand().containers[0].cards,
            CardDemand::Share {
                core_milli: 460,
                memory_mib: None
            }
        );
        assert_eq!(
            t[1].demand().gpu_models,
            Some(vec!["T4".to_string(), "P100".to_string()])
        );
        assert_eq!(
            t[0].demand().containers[0].cards,
            CardDemand::Whole {
                cards: 1,
                min_memory_mib: None
            }
        );
        assert!(t[2].demand().containers.is_empty());
        assert_eq!(t[2].demand().cpu_milli, 4000);

        let short = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,8,1000\n";
        let t = parse_tasks(&Csv::parse(short, Path::new("m.csv"))).unwrap();
        assert_eq!(t[0].demand().gpu_milli(), 8000);
    }

    #[test]
    fn bad_rows_name_file_line_and_column() {
        let bad = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,lots,1024,1,1000\n";
        let e = parse_tasks(&Csv::parse(bad, Path::new("pods.csv")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pods.csv:2") && e.contains("cpu_milli") && e.contains("lots"),
            "{e}"
        );
        let e = parse_tasks(&Csv::parse("name,cpu_milli\n", Path::new("p.csv")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("memory_mib"), "{e}");
        let multi_share = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,2,500\n";
        let e = parse_tasks(&Csv::parse(multi_share, Path::new("p.csv")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("one GPU only"), "{e}");
    }

    #[test]
    fn nodes_become_cards() {
        let csv = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,96000,786432,8,G2\n";
        let nodes = parse_nodes(&Csv::parse(csv, Path::new("n.csv"))).unwrap();
        let c = cluster_of(&nodes);
        assert_eq!(c.nodes.len(), 2);
        assert_eq!(c.gpu_capacity_milli(), 10_000);
        assert_eq!(c.model_name(c.nodes[1].cards[0].model), "G2");
    }
}
