//! The embedded default: a cluster and workload generated deterministically inside the binary,
//! shaped like the Alibaba trace (mixed models, many shares, some multi-GPU and model-bound
//! tasks), so the simulator runs anywhere with no input files.

use tessera_core::placement::Rng;

use super::trace::{TraceNode, TraceTask};

const SEED: u64 = 2023;

/// What the embedded default is, for the summary.
pub const DESCRIPTION: &str = "the embedded default is synthetic: generated inside the binary, modelled on the \
     Alibaba GPU trace (cluster-trace-gpu-v2023, the FGD paper's): 320 nodes with 1,490 GPUs of six models, \
     1,600 tasks of which about half are fractional-GPU shares, a tenth multi-GPU, 6% CPU-only, and a tenth \
     of the GPU tasks bound to models. Its figures show the policies' behaviour, not the real trace's: \
     run that with --trace (see the README).";

/// The embedded cluster: 320 nodes, 1,490 GPUs of six models.
pub fn nodes() -> Vec<TraceNode> {
    // (count, cpu cores, memory GiB, gpus, model)
    let kinds: [(usize, u64, u64, u32, &str); 6] = [
        (120, 96, 512, 8, "A100"),
        (40, 64, 256, 4, "V100M32"),
        (60, 64, 256, 2, "V100M16"),
        (70, 48, 192, 1, "T4"),
        (20, 96, 768, 8, "H100"),
        (10, 32, 128, 2, "A10"),
    ];
    let mut out = Vec::new();
    for (count, cores, mem_gib, gpus, model) in kinds {
        for _ in 0..count {
            out.push(TraceNode {
                name: format!("node-{:04}", out.len()),
                cpu_milli: cores * 1000,
                memory_mib: mem_gib * 1024,
                gpus,
                model: model.to_string(),
            });
        }
    }
    out
}

/// The embedded workload: 1,600 tasks asking for about 95% of the cluster's GPUs.
pub fn tasks() -> Vec<TraceTask> {
    let mut rng = Rng::new(SEED);
    let shares = [100u32, 200, 250, 300, 400, 460, 500, 600, 700, 800, 900];
    let specs = ["T4", "V100M16|V100M32", "A100|H100", "A10|T4"];
    let mut out = Vec::with_capacity(1600);
    for i in 0..1600 {
        let roll = rng.below(1000);
        let (num_gpu, gpu_milli) = match roll {
            0..=59 => (0, 0),
            60..=539 => (1, shares[rng.below(shares.len() as u64) as usize]),
            540..=909 => (1, 1000),
            910..=969 => (2, 1000),
            970..=989 => (4, 1000),
            _ => (8, 1000),
        };
        let per_gpu_cores = 2 + rng.below(11);
        let cpu_milli = (per_gpu_cores * 1000 * u64::from(num_gpu.max(1))).min(64_000);
        let memory_mib = cpu_milli / 1000 * 4096;
        let gpu_spec = if num_gpu > 0 && rng.below(10) == 0 {
            specs[rng.below(specs.len() as u64) as usize].to_string()
        } else {
            String::new()
        };
        out.push(TraceTask {
            name: format!("task-{i:05}"),
            cpu_milli,
            memory_mib,
            num_gpu,
            gpu_milli,
            gpu_spec,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_shaped_like_the_trace() {
        assert_eq!(tasks(), tasks());
        let t = tasks();
        let shares = t
            .iter()
            .filter(|t| t.num_gpu == 1 && t.gpu_milli < 1000 && t.gpu_milli > 0)
            .count();
        let multi = t.iter().filter(|t| t.num_gpu > 1).count();
        assert!((650..900).contains(&shares), "{shares}");
        assert!((100..250).contains(&multi), "{multi}");
        // What the summary says of it: about half shares, a tenth multi-GPU, 6% CPU-only, a
        // tenth of the GPU tasks bound to models.
        assert!(
            DESCRIPTION
                .contains("1,600 tasks of which about half are fractional-GPU shares, a tenth multi-GPU, 6% CPU-only")
        );
        assert!((720..880).contains(&shares), "{shares}");
        assert!((130..190).contains(&multi), "{multi}");
        let cpu = t.iter().filter(|t| t.num_gpu == 0).count();
        assert!((80..110).contains(&cpu), "{cpu}");
        let bound = t.iter().filter(|t| !t.gpu_spec.is_empty()).count() as f64 / (t.len() - cpu) as f64;
        assert!((0.08..0.12).contains(&bound), "{bound}");
        assert_eq!(t.len(), 1600);
        assert_eq!(nodes().len(), 320);
        let gpus: u32 = nodes().iter().map(|n| n.gpus).sum();
        assert_eq!(gpus, 1490);
        // The workload asks for roughly the cluster's GPU capacity.
        let milli: u64 = t.iter().map(|t| u64::from(t.num_gpu) * u64::from(t.gpu_milli)).sum();
        assert!((1_300_000..1_550_000).contains(&milli), "{milli}");
    }
}
