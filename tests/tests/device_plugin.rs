//! The device plugin against a fake kubelet: registration, device counts, health transitions,
//! kubelet restart, MIG reconfiguration, Allocate ordering and malformed requests.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tessera_core::inventory::{BUILTIN_FIXTURES, FixtureSource};
use tessera_device_plugin::manager::{self, Config, Source};
use tessera_proto::deviceplugin as api;
use tessera_tests::kubelet::FakeKubelet;
use tokio::sync::oneshot;
use tokio_stream::StreamExt;

struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    async fn shutdown(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

fn start(dir: &Path, fixture: &Path) -> Running {
    let config = Config {
        plugin_dir: dir.to_path_buf(),
        memory_unit_mib: 1024,
        poll: Duration::from_millis(100),
        recovery: Duration::from_millis(800),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(manager::run(
        config,
        Source::Fixture(FixtureSource::new(fixture)),
        async move {
            let _ = stopped.await;
        },
    ));
    Running { stop: Some(stop), task }
}

fn fixture_file(dir: &Path, name: &str) -> std::path::PathBuf {
    let text = BUILTIN_FIXTURES.iter().find(|(n, _)| *n == name).unwrap().1;
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text).unwrap();
    path
}

async fn list(k: &FakeKubelet, endpoint: &str) -> anyhow::Result<tonic::Streaming<api::ListAndWatchResponse>> {
    Ok(k.dial(endpoint)
        .await?
        .list_and_watch(api::Empty {})
        .await?
        .into_inner())
}

#[tokio::test]
async fn advertises_each_fixture() -> anyhow::Result<()> {
    let expected: [(&str, &[(&str, usize)]); 3] = [
        (
            "h100x8",
            &[("tessera.io/gpu-core", 800), ("tessera.io/gpu-memory", 632)],
        ),
        ("t4x2", &[("tessera.io/gpu-core", 200), ("tessera.io/gpu-memory", 30)]),
        (
            "a100-mig",
            &[
                ("tessera.io/gpu-core", 100),
                ("tessera.io/gpu-memory", 40),
                ("tessera.io/mig-1g.5gb", 9),
                ("tessera.io/mig-2g.10gb", 1),
                ("tessera.io/mig-3g.20gb", 2),
                ("tessera.io/mig-4g.20gb", 1),
            ],
        ),
    ];
    for (fixture, resources) in expected {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("plugins");
        std::fs::create_dir_all(&dir)?;
        let mut k = FakeKubelet::start(&dir)?;
        let plugin = start(&dir, &fixture_file(tmp.path(), fixture));
        let regs = k.registrations(resources.len()).await?;
        for (reg, (resource, count)) in regs.iter().zip(resources) {
            assert_eq!(reg.resource_name, *resource);
            assert_eq!(reg.version, "v1beta1");
            assert!(
                dir.join(&reg.endpoint).exists(),
                "served before registering: {}",
                reg.endpoint
            );
            let mig = resource.contains("/mig-");
            assert_eq!(reg.options.as_ref().unwrap().get_preferred_allocation_available, !mig);
            let mut client = k.dial(&reg.endpoint).await?;
            let opts = client.get_device_plugin_options(api::Empty {}).await?.into_inner();
            assert!(!opts.pre_start_required);
            let first = list(&k, &reg.endpoint).await?.next().await.unwrap()?;
            assert_eq!(first.devices.len(), *count, "{fixture} {resource}");
            assert!(first.devices.iter().all(|d| d.health == "Healthy" && d.id.len() <= 63));
            assert!(
                first
                    .devices
                    .iter()
                    .all(|d| d.topology.as_ref().is_some_and(|t| t.nodes.len() == 1))
            );
        }
        plugin.shutdown().await;
        let left: Vec<_> = std::fs::read_dir(&dir)?
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(
            left,
            vec!["kubelet.sock".to_string()],
            "{fixture}: sockets removed on shutdown"
        );
    }
    Ok(())
}

#[tokio::test]
async fn health_events_mark_units_unhealthy_then_recover() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("plugins");
    std::fs::create_dir_all(&dir)?;
    let mut k = FakeKubelet::start(&dir)?;
    let fixture = fixture_file(tmp.path(), "t4x2");
    let plugin = start(&dir, &fixture);
    let regs = k.registrations(2).await?;
    let mut stream = list(&k, &regs[0].endpoint).await?; // gpu-core
    let first = stream.next().await.unwrap()?;
    assert!(first.devices.iter().all(|d| d.health == "Healthy"));
    let gpu0 = first.devices[0].id.rsplit_once('-').unwrap().0.to_string();

    let text = std::fs::read_to_string(&fixture)?;
    std::fs::write(
        &fixture,
        format!("{text}health_events:\n  - {{ uuid: {gpu0}, xid: 79 }}\n"),
    )?;
    let next = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await?
        .unwrap()?;
    let unhealthy: Vec<&str> = next
        .devices
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(unhealthy.len(), 100, "every core unit of the GPU");
    assert!(unhealthy.iter().all(|id| id.starts_with(&gpu0)));
    // Quiet for the recovery period: healthy again, a new full list is sent.
    let back = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await?
        .unwrap()?;
    assert!(back.devices.iter().all(|d| d.health == "Healthy"));
    // An application XID changes nothing.
    std::fs::write(
        &fixture,
        format!("{text}health_events:\n  - {{ uuid: {gpu0}, xid: 79 }}\n  - {{ uuid: {gpu0}, xid: 13 }}\n"),
    )?;
    assert!(
        tokio::time::timeout(Duration::from_millis(600), stream.next())
            .await
            .is_err()
    );
    plugin.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn kubelet_restart_and_mig_reconfiguration() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("plugins");
    std::fs::create_dir_all(&dir)?;
    let mut k = FakeKubelet::start(&dir)?;
    let fixture = fixture_file(tmp.path(), "a100-mig");
    let plugin = start(&dir, &fixture);
    let regs = k.registrations(6).await?;

    k.restart().await?;
    let again = k.registrations(6).await?;
    let names = |r: &[api::RegisterRequest]| r.iter().map(|x| x.resource_name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&again), names(&regs), "every endpoint re-registered");
    for r in &again {
        assert!(dir.join(&r.endpoint).exists(), "socket re-created: {}", r.endpoint);
    }
    // The new endpoints answer.
    let first = list(&k, &again[0].endpoint).await?.next().await.unwrap()?;
    assert!(!first.devices.is_empty());

    // GPU 3 joins MIG mode with one 7g.40gb instance: gpu-core and gpu-memory go away, a new
    // resource appears, nothing else re-registers.
    let text = std::fs::read_to_string(&fixture)?;
    let text = text.replace(
        "    pci_bus_id: \"0000:4e:00.0\"\n",
        "    pci_bus_id: \"0000:4e:00.0\"\n    mig_enabled: true\n    mig_devices:\n      - { index: 0, uuid: MIG-7a7a7a7a-0000-4000-8000-000000000003, gi: 0, ci: 0, profile: 7g.40gb, memory_mib: 40192 }\n",
    );
    std::fs::write(&fixture, text)?;
    let reg = k.next_registration().await?;
    assert_eq!(reg.resource_name, "tessera.io/mig-7g.40gb");
    let mut stream = list(&k, &reg.endpoint).await?;
    assert_eq!(
        stream.next().await.unwrap()?.devices[0].id,
        "MIG-7a7a7a7a-0000-4000-8000-000000000003"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!dir.join("tessera-gpu-core.sock").exists() && !dir.join("tessera-gpu-memory.sock").exists());
    assert!(k.more_registrations(Duration::from_millis(300)).await.is_empty());
    plugin.shutdown().await;
    Ok(())
}

#[tokio::test]
async fn allocate_answers_in_order_and_rejects_bad_requests() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("plugins");
    std::fs::create_dir_all(&dir)?;
    let mut k = FakeKubelet::start(&dir)?;
    let plugin = start(&dir, &fixture_file(tmp.path(), "a100-mig"));
    let regs = k.registrations(6).await?;
    let by_name: BTreeMap<String, String> = regs
        .iter()
        .map(|r| (r.resource_name.clone(), r.endpoint.clone()))
        .collect();

    let core = &by_name["tessera.io/gpu-core"];
    let devices = list(&k, core).await?.next().await.unwrap()?.devices;
    let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
    let mut client = k.dial(core).await?;
    let resp = client
        .allocate(api::AllocateRequest {
            container_requests: vec![
                api::ContainerAllocateRequest {
                    devices_ids: ids[..30].to_vec(),
                },
                api::ContainerAllocateRequest {
                    devices_ids: ids[30..35].to_vec(),
                },
            ],
        })
        .await?
        .into_inner();
    let amounts: Vec<&str> = resp
        .container_responses
        .iter()
        .map(|r| r.annotations["tessera.io/allocated.gpu-core"].as_str())
        .collect();
    assert_eq!(amounts, ["30", "5"], "one response per request, in order");
    assert!(
        resp.container_responses
            .iter()
            .all(|r| r.devices.is_empty() && r.mounts.is_empty() && r.envs.is_empty())
    );

    let pref = client
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: ids.clone(),
                must_include_device_i_ds: vec![],
                allocation_size: 20,
            }],
        })
        .await?
        .into_inner();
    assert_eq!(pref.container_responses[0].device_i_ds.len(), 20);

    let mig = &by_name["tessera.io/mig-1g.5gb"];
    let mig_ids: Vec<String> = list(&k, mig)
        .await?
        .next()
        .await
        .unwrap()?
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();
    let resp = k
        .dial(mig)
        .await?
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: mig_ids[..2].to_vec(),
            }],
        })
        .await?
        .into_inner();
    assert_eq!(
        resp.container_responses[0].annotations["tessera.io/allocated.mig-1g.5gb.ids"],
        mig_ids[..2].join(",")
    );

    for bad in [
        vec!["GPU-nope-c00".to_string()],
        vec![],
        vec![ids[0].clone(), ids[0].clone()],
    ] {
        let err = client
            .allocate(api::AllocateRequest {
                container_requests: vec![api::ContainerAllocateRequest {
                    devices_ids: bad.clone(),
                }],
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}: {err}");
        assert!(err.message().contains("container request 0"), "{}", err.message());
    }
    plugin.shutdown().await;
    Ok(())
}

/// On GPUs bridged in pairs over two NUMA nodes: every device reports its card's NUMA node (for
/// the kubelet's topology manager), and a request for two whole cards' worth of core units,
/// with card 0 partly in use, is answered with the bridged pair 2-3, all of both cards' units.
#[tokio::test]
async fn preferred_whole_cards_follow_the_topology_and_devices_carry_numa() -> anyhow::Result<()> {
    use tessera_core::inventory::InventorySource as _;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("plugins");
    std::fs::create_dir_all(&dir)?;
    let mut k = FakeKubelet::start(&dir)?;
    let plugin = start(&dir, &fixture_file(tmp.path(), "a100-nvlink-pairs"));
    let regs = k.registrations(2).await?;
    let core = &regs
        .iter()
        .find(|r| r.resource_name == "tessera.io/gpu-core")
        .unwrap()
        .endpoint;
    let inv = FixtureSource::new("a100-nvlink-pairs").discover()?;
    let devices = list(&k, core).await?.next().await.unwrap()?.devices;
    for d in &devices {
        let card = inv.gpus.iter().find(|g| d.id.starts_with(&g.uuid)).unwrap();
        let numa: Vec<i64> = d.topology.as_ref().unwrap().nodes.iter().map(|n| n.id).collect();
        assert_eq!(numa, [i64::from(card.numa_node.unwrap())], "{}", d.id);
    }
    let available: Vec<String> = devices
        .iter()
        .map(|d| d.id.clone())
        .filter(|id| !(id.starts_with(&inv.gpus[0].uuid) && id.ends_with("-c07")))
        .collect();
    let pref = k
        .dial(core)
        .await?
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: vec![],
                allocation_size: 200,
            }],
        })
        .await?
        .into_inner();
    let ids = &pref.container_responses[0].device_i_ds;
    assert_eq!(ids.len(), 200);
    for (card, want) in [(2, 100), (3, 100)] {
        let n = ids.iter().filter(|id| id.starts_with(&inv.gpus[card].uuid)).count();
        assert_eq!(n, want, "card {card}: {ids:?}");
    }
    plugin.shutdown().await;
    Ok(())
}

/// A kubelet that turns registrations away at first (it creates `kubelet.sock` a moment before
/// it serves on it, so a plugin that registers on the socket's creation can be refused) gets
/// them again without `kubelet.sock` being re-created: the plugin retries. Before, it waited for
/// the next re-creation, and the node kept no Tessera resources until the kubelet restarted
/// again (seen in the real-cluster test).
#[tokio::test]
async fn a_refused_registration_is_retried() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("plugins");
    std::fs::create_dir_all(&dir)?;
    let mut k = FakeKubelet::start(&dir)?;
    k.refuse_next(3);
    let plugin = start(&dir, &fixture_file(tmp.path(), "t4x2"));
    let regs = k.registrations(2).await?;
    let names: Vec<&str> = regs.iter().map(|r| r.resource_name.as_str()).collect();
    assert_eq!(names, ["tessera.io/gpu-core", "tessera.io/gpu-memory"]);
    plugin.shutdown().await;
    Ok(())
}
