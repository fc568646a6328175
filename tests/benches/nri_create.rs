//! CRI CreateContainer time with the NRI plugin connected vs without it, same run, on both
//! containerd versions, and a GPU share with the driver mounted file by file vs as one bundle.
//! Prints the median and p90 per case, the median added time and the ratios. Run as root:
//! `cargo bench -p tessera-tests --bench nri_create`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation, SigningKeys};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::request::ContainerRole;
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin};
use tessera_nri_plugin::session::{self, Identity};
use tessera_tests::containerd::{ContainerSpec, Containerd, Version};
use tessera_tests::fake_node::fake_node;

const N: usize = 60;
const ROUNDS: usize = 6;

fn quantile(v: &mut [Duration], q: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// How a measured container gets its GPU.
#[derive(Clone, Copy, PartialEq)]
enum Gpu {
    /// None.
    No,
    /// A signed allocation for the plugin.
    Handoff,
    /// The same share device through the runtime's own CDI support (no plugin).
    Cdi,
}

async fn measure(
    c: &mut Containerd,
    tag: &str,
    mode: Gpu,
    keys: &SigningKeys,
    uuid: &str,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let gpu = mode == Gpu::Handoff;
    let uid = format!("uid-bench-{tag}");
    let mut a = Allocation::new("node-a", &uid);
    a.containers = (0..n)
        .map(|i| ContainerAllocation {
            name: format!("c{i}"),
            role: ContainerRole::App,
            devices: vec![AllocatedDevice::Gpu {
                uuid: uuid.into(),
                index: 0,
                minor: 0,
                core_percent: 1,
                memory_mib: 64,
                exclusive: false,
            }],
        })
        .collect();
    let s = keys.sign(&a);
    let annotations: Vec<(&str, &str)> = if gpu {
        vec![
            (ANNOTATION_ALLOCATION, s.allocation.as_str()),
            (ANNOTATION_ALLOCATION_SIGNATURE, s.signature.as_str()),
        ]
    } else {
        Vec::new()
    };
    let pod = c.run_pod_with_uid(&format!("bench-{tag}"), &uid, &annotations).await?;
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let mut spec = ContainerSpec::new(&format!("c{i}"), &["true"]);
        match mode {
            Gpu::Handoff => spec = spec.annotation("tessera.io/allocated.gpu-core", "1"),
            Gpu::Cdi => spec = spec.cdi("tessera.io/gpu=share-0"),
            Gpu::No => {}
        }
        let t = Instant::now();
        c.create_container(&pod, spec).await?;
        times.push(t.elapsed());
    }
    c.remove_pod(&pod).await?;
    Ok(times)
}

async fn bench(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let root = tempfile::tempdir()?;
    let inv = fake_node("h100x8", root.path())?;
    let (_, per_file) = spec::render(&inv, &SpecOptions::default())?;
    let bundle_dir =
        tessera_cdi_generator::bundle::prepare(&inv, std::path::Path::new("/"), &root.path().join("bundles"))?;
    let (_, bundled) = spec::render(
        &inv,
        &SpecOptions {
            driver_bundle: Some(bundle_dir),
            ..Default::default()
        },
    )?;
    let mounts = |t: &str| {
        serde_json::from_str::<serde_json::Value>(t)
            .map(|v| v["containerEdits"]["mounts"].as_array().map_or(0, Vec::len))
    };
    let (m_file, m_bundle) = (mounts(&per_file)?, mounts(&bundled)?);
    write_spec(&c.cdi_dir(), SPEC_FILE, &per_file)?;
    let keys = SigningKeys::new("k", [("k".to_string(), vec![1u8; 32])])?;
    let uuid = inv.gpus[0].uuid.clone();

    // Warm up the image and runtime paths, then measure without the plugin.
    // Rounds alternate between the runtime alone and with the plugin connected, so slow drift
    // of this machine falls on every case alike.
    measure(&mut c, "warm", Gpu::No, &keys, &uuid, 10).await?;
    let (mut without, mut cdi, mut plain, mut gpu) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut gpu_bundle = Vec::new();
    let per = N / ROUNDS;
    for round in 0..ROUNDS {
        without.extend(measure(&mut c, &format!("without-{round}"), Gpu::No, &keys, &uuid, per).await?);
        cdi.extend(measure(&mut c, &format!("cdi-{round}"), Gpu::Cdi, &keys, &uuid, per).await?);
        let plugin = Arc::new(TesseraPlugin::new(PluginConfig {
            node: "node-a".into(),
            keys: keys.verifying(),
            cdi_dirs: vec![c.cdi_dir()],
            enforcement: tessera_core::enforcement::ShareEnforcement::None,
            mps: Default::default(),
            hook: Default::default(),
            claims: Default::default(),
        }));
        let mut synced = plugin.synchronized();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(session::run_external(
            c.nri_socket(),
            Identity {
                name: "tessera".into(),
                idx: "10".into(),
            },
            plugin,
            async move {
                let _ = stopped.await;
            },
        ));
        tokio::time::timeout(Duration::from_secs(15), synced.wait_for(|n| *n > 0)).await??;
        plain.extend(measure(&mut c, &format!("plugin-nogpu-{round}"), Gpu::No, &keys, &uuid, per).await?);
        gpu.extend(measure(&mut c, &format!("plugin-gpu-{round}"), Gpu::Handoff, &keys, &uuid, per).await?);
        // The same share with the driver as one bundle (the spec is re-read once: warm up).
        write_spec(&c.cdi_dir(), SPEC_FILE, &bundled)?;
        measure(&mut c, &format!("bundle-warm-{round}"), Gpu::Handoff, &keys, &uuid, 1).await?;
        gpu_bundle.extend(
            measure(
                &mut c,
                &format!("plugin-bundle-{round}"),
                Gpu::Handoff,
                &keys,
                &uuid,
                per,
            )
            .await?,
        );
        write_spec(&c.cdi_dir(), SPEC_FILE, &per_file)?;
        let _ = stop.send(());
        task.await?;
        // The runtime notices the plugin is gone before the next round.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The plugin's own work per CreateContainer (verify, resolve, build the adjustment),
    // in-process, without the runtime or the transport.
    let plugin = TesseraPlugin::new(PluginConfig {
        node: "node-a".into(),
        keys: keys.verifying(),
        cdi_dirs: vec![c.cdi_dir()],
        enforcement: tessera_core::enforcement::ShareEnforcement::None,
        mps: Default::default(),
        hook: Default::default(),
        claims: Default::default(),
    });
    let mut a = Allocation::new("node-a", "uid-inproc");
    a.containers.push(ContainerAllocation {
        name: "c0".into(),
        role: ContainerRole::App,
        devices: vec![AllocatedDevice::share(&inv.gpus[0], 1, 64)],
    });
    let signed = keys.sign(&a);
    let mut pod = tessera_proto::nri::api::PodSandbox::new();
    pod.uid = "uid-inproc".into();
    pod.name = "inproc".into();
    let mut ctr = tessera_proto::nri::api::Container::new();
    ctr.name = "c0".into();
    let time_adjust = |pod: &tessera_proto::nri::api::PodSandbox, ctr: &tessera_proto::nri::api::Container| {
        let mut v: Vec<Duration> = (0..2000)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(plugin.adjust(pod, ctr).expect("adjusts"));
                t.elapsed()
            })
            .collect();
        quantile(&mut v, 0.5)
    };
    let no_gpu = time_adjust(&pod, &ctr);
    pod.annotations
        .insert(ANNOTATION_ALLOCATION.into(), signed.allocation.clone());
    pod.annotations
        .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature.clone());
    ctr.annotations
        .insert("tessera.io/allocated.gpu-core".into(), "1".into());
    let with_gpu = time_adjust(&pod, &ctr);

    let (m0, m1, m2) = (
        quantile(&mut without, 0.5),
        quantile(&mut plain, 0.5),
        quantile(&mut gpu, 0.5),
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "containerd {} ({N} CreateContainer calls per case, in {ROUNDS} alternating rounds)",
        c.package_version()
    );
    println!(
        "  without plugin            median {:7.3} ms  p90 {:7.3} ms",
        ms(m0),
        ms(quantile(&mut without, 0.9))
    );
    let mc = quantile(&mut cdi, 0.5);
    println!(
        "  no plugin, share via CDI  median {:7.3} ms  p90 {:7.3} ms",
        ms(mc),
        ms(quantile(&mut cdi, 0.9))
    );
    println!(
        "  plugin, container no GPU  median {:7.3} ms  p90 {:7.3} ms",
        ms(m1),
        ms(quantile(&mut plain, 0.9))
    );
    println!(
        "  plugin, GPU share         median {:7.3} ms  p90 {:7.3} ms",
        ms(m2),
        ms(quantile(&mut gpu, 0.9))
    );
    println!(
        "  added at the median: {:+.3} ms (no GPU), {:+.3} ms (GPU); ratio {:.3} / {:.3}",
        ms(m1) - ms(m0),
        ms(m2) - ms(m0),
        ms(m1) / ms(m0),
        ms(m2) / ms(m0)
    );
    println!(
        "  GPU share via the plugin vs the same devices via the runtime's CDI: {:+.3} ms; ratio {:.3}",
        ms(m2) - ms(mc),
        ms(m2) / ms(mc)
    );
    let mb = quantile(&mut gpu_bundle, 0.5);
    println!(
        "  plugin, GPU share, driver as one bundle ({m_bundle} spec-wide mounts instead of {m_file}): median {:7.3} ms  p90 {:7.3} ms",
        ms(mb),
        ms(quantile(&mut gpu_bundle, 0.9))
    );
    println!(
        "  one bundle vs file by file: {:+.3} ms; ratio {:.3}; added over no plugin: {:+.3} ms (ratio {:.3})",
        ms(mb) - ms(m2),
        ms(mb) / ms(m2),
        ms(mb) - ms(m0),
        ms(mb) / ms(m0)
    );
    println!(
        "  the plugin's own CreateContainer work (in-process median): {:.1} us (no GPU), {:.1} us (GPU share)",
        no_gpu.as_secs_f64() * 1e6,
        with_gpu.as_secs_f64() * 1e6
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    for v in Version::ALL {
        bench(v).await?;
    }
    Ok(())
}
