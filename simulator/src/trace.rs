//! The Alibaba GPU trace (cluster-trace-gpu-v2023, "openb") CSV files.

use std::collections::HashMap;
use std::io::Read as _;
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
    /// A value outside what the simulator accepts.
    #[error("{path}:{line}: {column}={value}: {why}")]
    Invalid {
        path: PathBuf,
        line: usize,
        column: &'static str,
        value: String,
        why: String,
    },
    /// A file too large to replay.
    #[error("{path}: {what}")]
    TooLarge { path: PathBuf, what: String },
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

/// The largest trace file read (the public trace's pod lists are about 0.6 MB): a bigger file
/// is refused before it is read whole.
pub const MAX_FILE_BYTES: u64 = 128 << 20;
/// The most nodes a node list may have: four times Kubernetes' documented limit of 5,000 nodes
/// per cluster (the public trace has 1,213 GPU nodes).
pub const MAX_NODES: usize = 20_000;
/// The most GPUs one node (or one task) may have: real servers have up to 16, and 64 is the
/// most Tessera's topology describes ([`tessera_core::topology::MAX_TOPOLOGY_GPUS`]). Each
/// card is modelled one by one, so this bounds the cluster's memory.
pub const MAX_GPUS_PER_NODE: u32 = tessera_core::topology::MAX_TOPOLOGY_GPUS as u32;
/// The most rows a pod list may have (the public trace has 8,152).
pub const MAX_TASKS: usize = 1_000_000;
/// The most CPU a node or a task may name, millicores (100,000 cores).
pub const MAX_CPU_MILLI: u64 = 100_000_000;
/// The most memory a node or a task may name, MiB (1 PiB; its bytes must fit 64 bits).
pub const MAX_MEMORY_MIB: u64 = 1 << 30;

/// A CSV file read whole; rows are split into fields only when read, so that a file of
/// commas costs no more than its size.
struct Csv {
    path: PathBuf,
    text: String,
    header: std::ops::Range<usize>,
    /// Per non-empty row: its line number (1 = the header) and where it lies in `text`.
    rows: Vec<(usize, std::ops::Range<usize>)>,
}

/// One row of a [`Csv`].
type Row = (usize, std::ops::Range<usize>);

impl Csv {
    fn read(path: &Path, max_rows: usize) -> Result<Self, TraceError> {
        let read = |source| TraceError::Read {
            path: path.into(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_string(&mut text))
            .map_err(read)?;
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(TraceError::TooLarge {
                path: path.into(),
                what: format!("larger than {} MiB", MAX_FILE_BYTES >> 20),
            });
        }
        Self::parse(text, path, max_rows)
    }

    fn parse(text: String, path: &Path, max_rows: usize) -> Result<Self, TraceError> {
        let mut header = 0..0;
        let mut rows = Vec::new();
        let mut at = 0;
        for (n, line) in text.split_inclusive('\n').enumerate() {
            let range = at..at + line.trim_end_matches(['\n', '\r']).len();
            at += line.len();
            if n == 0 {
                header = range;
            } else if !text[range.clone()].trim().is_empty() {
                if rows.len() == max_rows {
                    return Err(TraceError::TooLarge {
                        path: path.into(),
                        what: format!("more than {max_rows} rows"),
                    });
                }
                rows.push((n + 1, range));
            }
        }
        Ok(Self {
            path: path.into(),
            text,
            header,
            rows,
        })
    }

    fn col(&self, name: &'static str) -> Result<usize, TraceError> {
        self.text[self.header.clone()]
            .split(',')
            .position(|c| c.trim() == name)
            .ok_or(TraceError::Column {
                path: self.path.clone(),
                column: name,
            })
    }

    fn field(&self, row: &Row, col: usize) -> &str {
        self.text[row.1.clone()].split(',').nth(col).map_or("", str::trim)
    }

    fn num<T: std::str::FromStr>(&self, row: &Row, col: usize, name: &'static str) -> Result<T, TraceError> {
        let v = self.field(row, col);
        v.parse().map_err(|_| TraceError::Value {
            path: self.path.clone(),
            line: row.0,
            column: name,
            value: v.to_string(),
            what: "number",
        })
    }

    /// A number no larger than `max`.
    fn num_at_most<T>(&self, row: &Row, col: usize, name: &'static str, max: T, why: &str) -> Result<T, TraceError>
    where
        T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
    {
        let v: T = self.num(row, col, name)?;
        if v > max {
            return Err(self.invalid(row, name, v, format!("at most {max} {why}")));
        }
        Ok(v)
    }

    fn invalid(&self, row: &Row, column: &'static str, value: impl std::fmt::Display, why: String) -> TraceError {
        TraceError::Invalid {
            path: self.path.clone(),
            line: row.0,
            column,
            value: value.to_string(),
            why,
        }
    }
}

/// Reads an openb node list.
pub fn read_nodes(path: &Path) -> Result<Vec<TraceNode>, TraceError> {
    parse_nodes(&Csv::read(path, MAX_NODES)?)
}

fn parse_nodes(csv: &Csv) -> Result<Vec<TraceNode>, TraceError> {
    let (sn, cpu, mem, gpu, model) = (
        csv.col("sn")?,
        csv.col("cpu_milli")?,
        csv.col("memory_mib")?,
        csv.col("gpu")?,
        csv.col("model")?,
    );
    let mut seen: HashMap<&str, usize> = HashMap::new();
    csv.rows
        .iter()
        .map(|r| {
            let name = csv.field(r, sn);
            if name.is_empty() {
                return Err(csv.invalid(r, "sn", "\"\"", "every node needs a name".into()));
            }
            if let Some(first) = seen.insert(name, r.0) {
                return Err(csv.invalid(r, "sn", name, format!("line {first} has the same name")));
            }
            Ok(TraceNode {
                name: name.to_string(),
                cpu_milli: csv.num_at_most(r, cpu, "cpu_milli", MAX_CPU_MILLI, "millicores")?,
                memory_mib: csv.num_at_most(r, mem, "memory_mib", MAX_MEMORY_MIB, "MiB (1 PiB)")?,
                gpus: csv.num_at_most(
                    r,
                    gpu,
                    "gpu",
                    MAX_GPUS_PER_NODE,
                    "GPUs per node (servers have up to 16; Tessera's topology describes at most 64)",
                )?,
                model: csv.field(r, model).to_string(),
            })
        })
        .collect()
}

/// Reads an openb pod list.
pub fn read_tasks(path: &Path) -> Result<Vec<TraceTask>, TraceError> {
    parse_tasks(&Csv::read(path, MAX_TASKS)?)
}

fn parse_tasks(csv: &Csv) -> Result<Vec<TraceTask>, TraceError> {
    let (name, cpu, mem, num, milli) = (
        csv.col("name")?,
        csv.col("cpu_milli")?,
        csv.col("memory_mib")?,
        csv.col("num_gpu")?,
        csv.col("gpu_milli")?,
    );
    let spec = csv.col("gpu_spec").ok();
    csv.rows
        .iter()
        .map(|r| {
            let t = TraceTask {
                name: csv.field(r, name).to_string(),
                cpu_milli: csv.num_at_most(r, cpu, "cpu_milli", MAX_CPU_MILLI, "millicores")?,
                memory_mib: csv.num_at_most(r, mem, "memory_mib", MAX_MEMORY_MIB, "MiB (1 PiB)")?,
                num_gpu: csv.num_at_most(
                    r,
                    num,
                    "num_gpu",
                    MAX_GPUS_PER_NODE,
                    "GPUs per task (no node may have more)",
                )?,
                gpu_milli: csv.num(r, milli, "gpu_milli")?,
                gpu_spec: spec.map(|c| csv.field(r, c).to_string()).unwrap_or_default(),
            };
            check_gpu_ask(csv, r, &t)?;
            Ok(t)
        })
        .collect()
}

/// A task's `num_gpu` and `gpu_milli` together: a CPU pod asks 0 and 0; a GPU pod asks
/// 1..=1000 milli per GPU, below 1000 (a share) on one GPU only.
fn check_gpu_ask(csv: &Csv, r: &Row, t: &TraceTask) -> Result<(), TraceError> {
    let why = match (t.num_gpu, t.gpu_milli) {
        (0, 0) => return Ok(()),
        (0, _) => "a CPU pod (num_gpu=0) asks gpu_milli=0".to_string(),
        (n, 0) => format!("a GPU pod (num_gpu={n}) asks 1..={CARD_MILLI} milli per GPU (or num_gpu=0 for a CPU pod)"),
        (_, m) if m > CARD_MILLI => {
            format!("at most {CARD_MILLI} milli (one whole GPU) per GPU; ask more GPUs with num_gpu")
        }
        (1, _) | (_, CARD_MILLI) => return Ok(()),
        (n, m) => {
            return Err(TraceError::Task {
                path: csv.path.clone(),
                line: r.0,
                reason: format!(
                    "task {} asks for {n} GPU(s) x {m} milli; shares (below 1000) are for one GPU only",
                    t.name
                ),
            });
        }
    };
    Err(csv.invalid(r, "gpu_milli", t.gpu_milli, why))
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

    fn csv(text: &str, name: &str) -> Csv {
        Csv::parse(text.to_string(), Path::new(name), MAX_TASKS).unwrap()
    }

    #[test]
    fn parses_both_pod_list_layouts() {
        let full = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
                    p0,12000,16384,1,1000,,LS,Running,0,1,0\n\
                    p1,6000,12288,1,460,T4|P100,LS,Running,0,1,0\n\
                    p2,4000,8192,0,0,,BE,Running,0,1,0\n";
        let t = parse_tasks(&csv(full, "pods.csv")).unwrap();
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
        let t = parse_tasks(&csv(short, "m.csv")).unwrap();
        assert_eq!(t[0].demand().gpu_milli(), 8000);
    }

    #[test]
    fn bad_rows_name_file_line_and_column() {
        let bad = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,lots,1024,1,1000\n";
        let e = parse_tasks(&csv(bad, "pods.csv")).unwrap_err().to_string();
        assert!(
            e.contains("pods.csv:2") && e.contains("cpu_milli") && e.contains("lots"),
            "{e}"
        );
        let e = parse_tasks(&csv("name,cpu_milli\n", "p.csv")).unwrap_err().to_string();
        assert!(e.contains("memory_mib"), "{e}");
        let multi_share = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,2,500\n";
        let e = parse_tasks(&csv(multi_share, "p.csv")).unwrap_err().to_string();
        assert!(e.contains("one GPU only"), "{e}");
    }

    #[test]
    fn nodes_become_cards() {
        let text = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,96000,786432,8,G2\n";
        let nodes = parse_nodes(&csv(text, "n.csv")).unwrap();
        let c = cluster_of(&nodes);
        assert_eq!(c.nodes.len(), 2);
        assert_eq!(c.gpu_capacity_milli(), 10_000);
        assert_eq!(c.model_name(c.nodes[1].cards[0].model), "G2");
    }
}
