//! Whether a scenario is worth running: bounded work, and tasks that can fit somewhere.
//!
//! Checked before any run: a workload that asks for no GPU (the replay would never reach its
//! target), one so small against the cluster that the replay would submit millions of tasks,
//! one whose work per run is far beyond the public trace's, and one of which no GPU task fits
//! any node even on an empty cluster are refused; one of which some tasks never fit is run
//! with a warning.

use std::collections::HashMap;

use tessera_core::placement::{CardDemand, ClusterState, PodDemand};

use super::Scenario;

/// The most tasks one run may be expected to submit (the public trace's runs submit about
/// 10,800); [`super::run`] never submits more than twice this.
pub const MAX_TASKS_PER_RUN: u64 = 2_000_000;

/// The most work one run may be expected to do, counted as tasks submitted x nodes x classes
/// of the target workload (each placement scores every node, and each score weighs every
/// class): about 100 times the public trace's run (10,800 x 1,213 x 40 = 5.2e8, 6 s on one
/// core).
pub const MAX_WORK_PER_RUN: f64 = 5e10;

/// The share of the requested GPU compute that can never be placed from which a warning is
/// printed before the tables (below it, the summary says so).
pub const WARN_SHARE: f64 = 0.1;

/// Why a scenario is not run.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Nothing to measure: no task asks for a GPU.
    #[error(
        "no task asks for a GPU ({0} CPU-only task(s)): the simulator measures GPU allocation, which would stay at 0"
    )]
    NoGpuTask(usize),
    /// The tasks are tiny against the cluster: filling it would take too many.
    #[error(
        "the {tasks} task(s) ask for {milli} milli-GPU in all, against {gpus} GPUs; replaying them up to {inflate}% of the GPU capacity would submit about {per_run} tasks per run, at most {MAX_TASKS_PER_RUN}"
    )]
    TooManyTasks {
        tasks: usize,
        milli: u64,
        gpus: u64,
        inflate: f64,
        per_run: u64,
    },
    /// Each run would take far longer than the public trace's.
    #[error(
        "about {per_run} tasks per run x {nodes} nodes x {classes} workload classes = {work:.1e} class evaluations per run, at most {MAX_WORK_PER_RUN:.0e} (the public trace: 5.2e8, about 6 s): use fewer nodes or tasks, or tasks of fewer distinct shapes"
    )]
    TooMuchWork {
        per_run: u64,
        nodes: usize,
        classes: usize,
        work: f64,
    },
    /// No GPU task fits any node.
    #[error(
        "none of the {tasks} GPU task(s) fits any node, even on an empty cluster ({example}): every table would be zeros"
    )]
    NothingFits { tasks: usize, example: String },
}

/// What a scenario will cost and what of it can never be placed.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Tasks one run is expected to submit.
    pub tasks_per_run: u64,
    /// Its work (see [`MAX_WORK_PER_RUN`]).
    pub work_per_run: f64,
    /// GPU tasks in the trace.
    pub gpu_tasks: usize,
    /// Their GPU compute, milli.
    pub gpu_milli: u64,
    /// GPU tasks that fit no node even on an empty cluster.
    pub never_fit: usize,
    /// Their GPU compute, milli.
    pub never_fit_milli: u64,
    /// The first of them and why, named by `name`.
    pub example: Option<String>,
}

impl Plan {
    /// Share of the requested GPU compute that can never be placed, 0..=1.
    pub fn never_fit_share(&self) -> f64 {
        self.never_fit_milli as f64 / self.gpu_milli.max(1) as f64
    }

    /// What of the workload can never be placed, in a sentence (`None` when all of it can).
    pub fn never_fit_sentence(&self) -> Option<String> {
        (self.never_fit > 0).then(|| {
            format!(
                "{} of {} GPU task(s) ({:.1}% of the requested GPU compute) fit no node even on an empty cluster ({}); every policy drops them each time they arrive.",
                self.never_fit,
                self.gpu_tasks,
                100.0 * self.never_fit_share(),
                self.example.as_deref().unwrap_or("")
            )
        })
    }

    /// A line to print before the tables when at least [`WARN_SHARE`] of the requested GPU
    /// compute can never be placed.
    pub fn warning(&self) -> Option<String> {
        if self.never_fit_share() < WARN_SHARE {
            return None;
        }
        let head = if self.never_fit_share() >= 0.5 {
            "most of this workload can never be placed: "
        } else {
            ""
        };
        Some(format!("warning: {head}{}", self.never_fit_sentence()?))
    }
}

/// Checks `scenario`; `name(i)` names its task `i` in messages.
pub fn check(scenario: &Scenario, name: &dyn Fn(usize) -> String) -> Result<Plan, CheckError> {
    let tasks = &scenario.tasks;
    let gpu_milli: u64 = tasks.iter().map(PodDemand::gpu_milli).sum();
    let gpu_tasks = tasks.iter().filter(|t| t.gpu_milli() > 0).count();
    if gpu_milli == 0 {
        return Err(CheckError::NoGpuTask(tasks.len()));
    }
    let capacity = scenario.cluster.gpu_capacity_milli() as f64;
    let pct = 100.0 * gpu_milli as f64 / capacity.max(1.0);
    let per_run = (tasks.len() as f64 * (scenario.inflate_to / pct).max(1.0)).ceil();
    if per_run > MAX_TASKS_PER_RUN as f64 {
        return Err(CheckError::TooManyTasks {
            tasks: tasks.len(),
            milli: gpu_milli,
            gpus: scenario.cluster.gpu_capacity_milli() / 1000,
            inflate: scenario.inflate_to,
            per_run: per_run as u64,
        });
    }
    let (nodes, classes) = (scenario.cluster.nodes.len(), scenario.workload.classes.len());
    let work = per_run * nodes as f64 * classes.max(1) as f64;
    if work > MAX_WORK_PER_RUN {
        return Err(CheckError::TooMuchWork {
            per_run: per_run as u64,
            nodes,
            classes,
            work,
        });
    }
    let offers = offers(&scenario.cluster);
    let mut memo: HashMap<&PodDemand, Option<String>> = HashMap::new();
    let (mut never_fit, mut never_fit_milli, mut example) = (0, 0, None);
    for (i, t) in tasks.iter().enumerate().filter(|(_, t)| t.gpu_milli() > 0) {
        let why = memo
            .entry(t)
            .or_insert_with(|| why_never(t, &offers, &scenario.cluster));
        if let Some(why) = why {
            never_fit += 1;
            never_fit_milli += t.gpu_milli();
            example.get_or_insert_with(|| format!("e.g. task {}: {why}", name(i)));
        }
    }
    if never_fit == gpu_tasks {
        return Err(CheckError::NothingFits {
            tasks: gpu_tasks,
            example: example.unwrap_or_default(),
        });
    }
    Ok(Plan {
        tasks_per_run: per_run as u64,
        work_per_run: work,
        gpu_tasks,
        gpu_milli,
        never_fit,
        never_fit_milli,
        example,
    })
}

/// What an empty node offers a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Offer {
    cards: usize,
    cpu_milli: u64,
    memory_bytes: u64,
    model: Option<u16>,
}

/// The distinct offers of the cluster's schedulable nodes, most cards first (a task that fits
/// is found early).
fn offers(cluster: &ClusterState) -> Vec<Offer> {
    let mut offers: Vec<Offer> = cluster
        .nodes
        .iter()
        .filter(|n| n.schedulable)
        .map(|n| Offer {
            cards: n.cards.iter().filter(|c| c.healthy && c.offers_compute()).count(),
            cpu_milli: n.cpu_milli,
            memory_bytes: n.memory_bytes,
            model: n.model(),
        })
        .collect();
    offers.sort_unstable_by(|a, b| b.cmp(a));
    offers.dedup();
    offers
}

/// Why `task` fits none of `offers` (`None` when it fits one). Tasks of the trace's shape
/// only (one container, a share or whole cards); any other is taken to fit.
fn why_never(task: &PodDemand, offers: &[Offer], cluster: &ClusterState) -> Option<String> {
    let need = match &task.containers[..] {
        [] => 0,
        [c] => match c.cards {
            CardDemand::Share { .. } => 1,
            CardDemand::Whole { cards, .. } => cards as usize,
            CardDemand::Mig(_) => return None,
        },
        _ => return None,
    };
    let allowed = cluster.allowed_models(task.gpu_models.as_deref());
    let model_ok = |o: &&Offer| need == 0 || o.model.is_some_and(|m| allowed[usize::from(m)]);
    let fits = |o: &&Offer| o.cards >= need && o.cpu_milli >= task.cpu_milli && o.memory_bytes >= task.memory_bytes;
    if offers.iter().filter(model_ok).any(|o| fits(&o)) {
        return None;
    }
    let of_model = task
        .gpu_models
        .as_ref()
        .map_or(String::new(), |m| format!(" of model {}", m.join("|")));
    let Some(most) = offers.iter().filter(model_ok).map(|o| o.cards).max() else {
        return Some(format!("no node has a GPU{of_model}"));
    };
    if most < need {
        return Some(format!("it asks {need} GPUs; the largest node{of_model} has {most}"));
    }
    Some(format!(
        "it asks {} millicores and {} MiB with {need} GPU(s); no node{of_model} with as many GPUs has as much",
        task.cpu_milli,
        task.memory_bytes >> 20
    ))
}

#[cfg(test)]
mod tests {
    use tessera_core::placement::{Engine, EngineConfig, TargetWorkload};
    use tessera_core::policy::PolicyKind;

    use super::*;
    use crate::{embedded, trace};

    fn scenario(nodes: Vec<trace::TraceNode>, tasks: &[trace::TraceTask]) -> Scenario {
        let demands = tasks.iter().map(trace::TraceTask::demand).collect();
        Scenario::new("t", trace::cluster_of(&nodes), demands)
    }

    /// "Fits no empty node" is what the engine says of the task on the empty cluster.
    #[test]
    fn never_fit_agrees_with_the_engine() {
        let mut tasks = embedded::tasks();
        let node = |name: &str, cpu: u64, gpus: u32, model: &str| trace::TraceNode {
            name: name.into(),
            cpu_milli: cpu,
            memory_mib: 65_536,
            gpus,
            model: model.into(),
        };
        let mut nodes = embedded::nodes();
        nodes.push(node("cpu-only", 256_000, 0, ""));
        tasks[0].cpu_milli = 200_000; // fits the CPU node's CPU only: never as a GPU task
        let s = scenario(nodes, &tasks);
        let config = EngineConfig {
            node_policy: PolicyKind::Binpack,
            gpu_policy: PolicyKind::Binpack,
            seed: 1,
        };
        let offers = offers(&s.cluster);
        let (mut fit, mut never) = (0, 0);
        for t in s.tasks.iter().filter(|t| t.gpu_milli() > 0) {
            let mut engine = Engine::new(s.cluster.clone(), &TargetWorkload::default(), config);
            let why = why_never(t, &offers, &s.cluster);
            assert_eq!(why.is_none(), engine.schedule(t).is_ok(), "{t:?}: {why:?}");
            if why.is_some() { never += 1 } else { fit += 1 }
        }
        assert!(fit > 1000 && never >= 2, "{fit} fit, {never} never");
    }

    #[test]
    fn plans_count_what_never_fits_and_refuse_what_cannot_run() {
        let t4 = trace::TraceNode {
            name: "n0".into(),
            cpu_milli: 32_000,
            memory_mib: 65_536,
            gpus: 2,
            model: "T4".into(),
        };
        let task = |num_gpu, gpu_milli, spec: &str| trace::TraceTask {
            name: format!("t{num_gpu}-{spec}"),
            cpu_milli: 1000,
            memory_mib: 1024,
            num_gpu,
            gpu_milli,
            gpu_spec: spec.into(),
        };
        let name = |i: usize| format!("#{i}");
        let s = scenario(
            vec![t4.clone()],
            &[task(1, 500, ""), task(1, 1000, "A100"), task(0, 0, "")],
        );
        let plan = check(&s, &name).unwrap();
        assert_eq!((plan.gpu_tasks, plan.never_fit, plan.never_fit_milli), (2, 1, 1000));
        assert!(plan.warning().unwrap().starts_with("warning: most of this workload"));
        assert_eq!(
            plan.example.as_deref(),
            Some("e.g. task #1: no node has a GPU of model A100")
        );
        let s = scenario(
            vec![t4.clone()],
            &[
                task(1, 1000, ""),
                task(1, 1000, ""),
                task(1, 1000, ""),
                task(2, 1000, "A100"),
            ],
        );
        let e = check(&s, &name).unwrap();
        assert!(
            e.warning().unwrap().starts_with("warning: 1 of 4 GPU task(s) (40.0%"),
            "{e:?}"
        );
        let s = scenario(vec![t4.clone()], &[task(4, 1000, "")]);
        let e = check(&s, &name).unwrap_err().to_string();
        assert!(e.contains("it asks 4 GPUs; the largest node has 2"), "{e}");
        let s = scenario(vec![t4], &[task(0, 0, "")]);
        assert!(matches!(check(&s, &name), Err(CheckError::NoGpuTask(1))));
    }

    /// The embedded default passes, a few of its tasks fitting nowhere (too small a share of
    /// it to warn about).
    #[test]
    fn the_embedded_default_is_within_bounds() {
        let s = scenario(embedded::nodes(), &embedded::tasks());
        let plan = check(&s, &|i| i.to_string()).unwrap();
        assert_eq!(plan.tasks_per_run, 2136);
        assert!(plan.work_per_run < MAX_WORK_PER_RUN / 100.0);
        assert!(plan.never_fit_share() < WARN_SHARE && plan.warning().is_none());
        assert!(plan.never_fit_sentence().is_some());
    }
}
