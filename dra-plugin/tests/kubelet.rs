//! The plugin driven as the kubelet drives it, over its real sockets, for what a real kubelet
//! cannot be made to do on cue: a plugin restart between two prepares, a malformed claim, a
//! claim deleted after it was prepared. (tests/tests/cluster.rs drives it with the real one.)

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use k8s_openapi::api::resource::v1 as resource;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera_core::dra::{self, ClaimStore, DRIVER};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::inventory::FixtureSource;
use tessera_dra_plugin::driver::{ClaimSource, SourceError};
use tessera_dra_plugin::service::{self, Config};
use tessera_proto::dra as api;
use tessera_proto::dra::dra_plugin_client::DraPluginClient;
use tessera_proto::pluginregistration as reg;
use tessera_proto::pluginregistration::registration_client::RegistrationClient;
use tonic::transport::{Channel, Endpoint, Uri};

const NODE: &str = "node-a";

/// Claims as a test sets them; `get` counts its calls.
#[derive(Default)]
struct FakeClaims {
    claims: Mutex<HashMap<String, resource::ResourceClaim>>,
    reads: Mutex<usize>,
}

#[tonic::async_trait]
impl ClaimSource for FakeClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<resource::ResourceClaim, SourceError> {
        *self.reads.lock().unwrap() += 1;
        self.claims
            .lock()
            .unwrap()
            .get(&format!("{namespace}/{name}"))
            .cloned()
            .ok_or_else(|| SourceError::NotFound {
                what: format!("claim {namespace}/{name}"),
            })
    }
}

impl FakeClaims {
    fn set(&self, c: resource::ResourceClaim) {
        let key = format!(
            "{}/{}",
            c.metadata.namespace.as_deref().unwrap(),
            c.metadata.name.as_deref().unwrap()
        );
        self.claims.lock().unwrap().insert(key, c);
    }
    fn reads(&self) -> usize {
        *self.reads.lock().unwrap()
    }
}

fn allocated(name: &str, uid: &str, device: &str, consumed: &[(&str, &str)]) -> resource::ResourceClaim {
    resource::ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("team-a".into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: Default::default(),
        status: Some(resource::ResourceClaimStatus {
            allocation: Some(resource::AllocationResult {
                devices: Some(resource::DeviceAllocationResult {
                    results: Some(vec![resource::DeviceRequestAllocationResult {
                        driver: DRIVER.into(),
                        pool: NODE.into(),
                        device: device.into(),
                        request: "gpu".into(),
                        share_id: (!consumed.is_empty()).then(|| format!("share-{uid}")),
                        consumed_capacity: (!consumed.is_empty()).then(|| {
                            consumed
                                .iter()
                                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                                .collect()
                        }),
                        ..Default::default()
                    }]),
                    config: None,
                }),
                ..Default::default()
            }),
            reserved_for: None,
            devices: None,
        }),
    }
}

struct Plugin {
    dirs: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Plugin {
    fn start(dirs: &Path, claims: Arc<FakeClaims>) -> Self {
        Self::start_on(dirs, claims, Path::new("t4x2"), None)
    }

    /// A plugin whose cards are fixture `fixture`, creating MIG instances through `partitioner`.
    fn start_on(
        dirs: &Path,
        claims: Arc<FakeClaims>,
        fixture: &Path,
        partitioner: Option<Arc<dyn tessera_core::inventory::MigPartitioner>>,
    ) -> Self {
        Self::start_polling(dirs, claims, fixture, partitioner, Duration::from_millis(100))
    }

    /// [`Plugin::start_on`], reading the cards every `poll`.
    fn start_polling(
        dirs: &Path,
        claims: Arc<FakeClaims>,
        fixture: &Path,
        partitioner: Option<Arc<dyn tessera_core::inventory::MigPartitioner>>,
        poll: Duration,
    ) -> Self {
        let config = Config {
            node: NODE.into(),
            registry_dir: dirs.join("plugins_registry"),
            plugin_dir: dirs.join("plugins").join(DRIVER),
            cdi_dir: dirs.join("cdi"),
            state_dir: dirs.join("state"),
            memory_unit_mib: 1024,
            poll,
            partitioner,
            cdi_wait: Duration::from_secs(5),
            grants_dir: dirs.join("grants"),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(service::run(
            config,
            Arc::new(FixtureSource::new(fixture)),
            claims,
            None,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            dirs: dirs.to_path_buf(),
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }

    fn cdi(&self) -> PathBuf {
        self.dirs.join("cdi")
    }

    fn store(&self) -> ClaimStore {
        ClaimStore::new(&self.dirs.join("state"))
    }
}

async fn channel(socket: PathBuf) -> Channel {
    for _ in 0..100 {
        if socket.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await
        .unwrap()
}

fn claim_ref(name: &str, uid: &str) -> api::Claim {
    api::Claim {
        namespace: "team-a".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

async fn prepare(
    client: &mut DraPluginClient<Channel>,
    claims: &[api::Claim],
) -> HashMap<String, api::NodePrepareResourceResponse> {
    client
        .node_prepare_resources(api::NodePrepareResourcesRequest {
            claims: claims.to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .claims
}

#[tokio::test]
async fn registers_prepares_once_across_a_restart_and_unprepares_what_it_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let claims = Arc::new(FakeClaims::default());
    let plugin = Plugin::start(dir.path(), claims.clone());

    // Registration: who the plugin is and where the kubelet finds its DRA service.
    let mut registration =
        RegistrationClient::new(channel(dir.path().join("plugins_registry/gpu.tessera.io-reg.sock")).await);
    let info = registration.get_info(reg::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (
            info.r#type.as_str(),
            info.name.as_str(),
            info.supported_versions.clone()
        ),
        ("DRAPlugin", "gpu.tessera.io", vec!["v1.DRAPlugin".to_string()])
    );
    assert_eq!(
        PathBuf::from(&info.endpoint),
        dir.path().join("plugins/gpu.tessera.io/dra.sock")
    );
    registration
        .notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();

    // The health stream the kubelet watches: every card, healthy, in this node's pool.
    let mut health = tessera_proto::drahealth::dra_resource_health_client::DraResourceHealthClient::new(
        channel(info.endpoint.clone().into()).await,
    );
    let mut stream = health
        .node_watch_resources(tessera_proto::drahealth::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let seen: Vec<(String, String, i32)> = first
        .devices
        .iter()
        .map(|d| {
            let id = d.device.clone().unwrap();
            (id.pool_name, id.device_name, d.health)
        })
        .collect();
    let healthy = tessera_proto::drahealth::HealthStatus::Healthy as i32;
    assert_eq!(
        seen,
        [
            (NODE.to_string(), "gpu-0".to_string(), healthy),
            (NODE.to_string(), "gpu-1".to_string(), healthy)
        ]
    );

    // A share and a malformed claim in one call: the share is prepared, the other refused
    // with what is wrong, and neither holds the other up.
    claims.set(allocated(
        "share",
        "u-share",
        "gpu-0",
        &[("cores", "30"), ("memory", "4Gi")],
    ));
    claims.set(allocated(
        "bad",
        "u-bad",
        "gpu-0",
        &[("cores", "thirty"), ("memory", "4Gi")],
    ));
    let mut client = DraPluginClient::new(channel(info.endpoint.clone().into()).await);
    let got = prepare(&mut client, &[claim_ref("share", "u-share"), claim_ref("bad", "u-bad")]).await;
    let share = &got["u-share"];
    assert_eq!(share.error, "");
    assert_eq!(share.devices.len(), 1);
    let d = &share.devices[0];
    assert_eq!(
        (
            d.pool_name.as_str(),
            d.device_name.as_str(),
            d.request_names.clone(),
            d.share_id.as_deref()
        ),
        (NODE, "gpu-0", vec!["gpu".to_string()], Some("share-u-share"))
    );
    assert_eq!(d.cdi_device_ids, ["tessera.io/claim=u-share_gpu"]);
    assert!(
        got["u-bad"]
            .error
            .contains("consumedCapacity cores=\"thirty\" is invalid"),
        "{:?}",
        got["u-bad"]
    );
    assert!(got["u-bad"].devices.is_empty());
    // What the node recorded, and the marker the runtime injects.
    let record = plugin.store().get("u-share").unwrap().unwrap();
    assert!(matches!(
        record.devices[0].allocated,
        AllocatedDevice::Gpu {
            core_percent: 30,
            memory_mib: 4096,
            exclusive: false,
            ..
        }
    ));
    let marker: tessera_core::cdi::CdiSpec =
        serde_json::from_slice(&std::fs::read(plugin.cdi().join("tessera.io-claim-u-share.json")).unwrap()).unwrap();
    assert_eq!(marker, dra::marker_spec(&record));
    assert_eq!(record.markers["gpu"].len(), 32);
    assert!(plugin.store().get("u-bad").unwrap().is_none());
    assert!(!plugin.cdi().join("tessera.io-claim-u-bad.json").exists());

    // The plugin restarts (a rolling update), the claim is deleted from the API meanwhile,
    // and the marker of a prepare cut short lies in the CDI directory: the kubelet's repeated
    // prepare is answered from the record, not prepared twice; the orphan marker is gone.
    let reads = claims.reads();
    plugin.stop().await;
    claims.claims.lock().unwrap().clear();
    std::fs::write(dir.path().join("cdi/tessera.io-claim-u-cut.json"), b"{}").unwrap();
    std::fs::remove_file(dir.path().join("cdi/tessera.io-claim-u-share.json")).unwrap();
    let plugin = Plugin::start(dir.path(), claims.clone());
    let mut client = DraPluginClient::new(channel(info.endpoint.clone().into()).await);
    let again = prepare(&mut client, &[claim_ref("share", "u-share")]).await;
    assert_eq!(again["u-share"], *share);
    assert_eq!(claims.reads(), reads, "a recorded claim is not read or prepared again");
    assert!(
        plugin.cdi().join("tessera.io-claim-u-share.json").exists(),
        "the marker is written again"
    );
    assert!(!dir.path().join("cdi/tessera.io-claim-u-cut.json").exists());

    // A deleted claim the node never prepared is an error for that claim.
    let missing = prepare(&mut client, &[claim_ref("gone", "u-gone")]).await;
    assert!(missing["u-gone"].error.contains("not found"), "{:?}", missing["u-gone"]);
    // Something that is no uid never becomes a path.
    let evil = prepare(&mut client, &[claim_ref("x", "../../etc/x")]).await;
    assert!(evil["../../etc/x"].error.contains("is not a uid"));

    // Unprepare: record and marker go; a second unprepare is no error.
    for _ in 0..2 {
        let out = client
            .node_unprepare_resources(api::NodeUnprepareResourcesRequest {
                claims: vec![claim_ref("share", "u-share")],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(out.claims["u-share"].error, "");
    }
    assert!(plugin.store().get("u-share").unwrap().is_none());
    assert!(!plugin.cdi().join("tessera.io-claim-u-share.json").exists());
    plugin.stop().await;
    // The sockets are removed on the way out.
    assert!(!dir.path().join("plugins_registry/gpu.tessera.io-reg.sock").exists());
    assert!(!dir.path().join("plugins/gpu.tessera.io/dra.sock").exists());
}

/// The scheduler's allocator knows no tenants: a card's shares of two namespaces (tenants by
/// default) are refused at prepare, naming the card, the tenant it serves and the opt-in; the
/// same tenant's second share, another card, and a whole card are prepared.
#[tokio::test]
async fn a_cards_shares_are_prepared_for_one_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let claims = Arc::new(FakeClaims::default());
    let plugin = Plugin::start(dir.path(), claims.clone());
    let in_ns = |mut c: resource::ResourceClaim, ns: &str| {
        c.metadata.namespace = Some(ns.into());
        c
    };
    let share = [("cores", "30"), ("memory", "4Gi")];
    claims.set(allocated("a1", "u-a1", "gpu-0", &share));
    claims.set(allocated("a2", "u-a2", "gpu-0", &share));
    claims.set(in_ns(allocated("b1", "u-b1", "gpu-0", &share), "team-b"));
    claims.set(in_ns(allocated("b2", "u-b2", "gpu-1", &share), "team-b"));
    let endpoint = dir.path().join("plugins/gpu.tessera.io/dra.sock");
    let mut client = DraPluginClient::new(channel(endpoint).await);
    let b_ref = |name: &str, uid: &str| api::Claim {
        namespace: "team-b".into(),
        ..claim_ref(name, uid)
    };
    // The node's GPUs are read at the first poll.
    let mut got = HashMap::new();
    for _ in 0..50 {
        got = prepare(&mut client, &[claim_ref("a1", "u-a1")]).await;
        if got["u-a1"].error.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got["u-a1"].error, "");
    let got = prepare(
        &mut client,
        &[b_ref("b1", "u-b1"), claim_ref("a2", "u-a2"), b_ref("b2", "u-b2")],
    )
    .await;
    let refused = &got["u-b1"].error;
    assert!(
        refused.contains("already serves shares of tenant \"team-a\"")
            && refused.contains("claim team-a/a1")
            && refused.contains("tessera.io/cross-tenant-sharing=true"),
        "{refused}"
    );
    assert!(got["u-b1"].devices.is_empty());
    assert!(
        plugin.store().get("u-b1").unwrap().is_none(),
        "a refused claim was recorded"
    );
    assert_eq!((got["u-a2"].error.as_str(), got["u-b2"].error.as_str()), ("", ""));
    // One record that cannot be read no longer stands in every other claim's way: it is set
    // aside at the next poll, and the next share is prepared.
    std::fs::write(plugin.store().dir().join("u-broken.json"), "{").unwrap();
    claims.set(allocated("a3", "u-a3", "gpu-0", &share));
    let got = prepare(&mut client, &[claim_ref("a3", "u-a3")]).await;
    assert_eq!(got["u-a3"].error, "");
    let aside = plugin.store().dir().join("unreadable/u-broken.json");
    for _ in 0..100 {
        if aside.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(aside.exists() && !plugin.store().dir().join("u-broken.json").exists());
    plugin.stop().await;
}

/// A card stays held while a live container uses it, as the NRI plugin's grant records say,
/// also when the container's claim is gone (unprepared and deallocated while the container
/// still ran): a whole-card claim on it, or another tenant's share, waits at prepare, naming
/// the container, and is prepared once the container is gone. Before, only claim records
/// counted and the card was prepared for the next claim at once.
#[tokio::test]
async fn a_card_a_live_container_uses_is_prepared_for_no_one_else() {
    use tessera_core::granted::{GrantStore, Granted};
    let dir = tempfile::tempdir().unwrap();
    let claims = Arc::new(FakeClaims::default());
    let plugin = Plugin::start(dir.path(), claims.clone());
    let inv = tessera_core::inventory::InventorySource::discover(&FixtureSource::new("t4x2")).unwrap();
    let grants = GrantStore::new(dir.path().join("grants"));
    let live = Granted {
        namespace: "team-b".into(),
        pod: "trainer".into(),
        pod_uid: "uid-trainer".into(),
        container: "main".into(),
        devices: vec![AllocatedDevice::whole(&inv.gpus[0])],
        claims: [("u-gone".to_string(), vec![inv.gpus[0].uuid.clone()])].into(),
        ..Default::default()
    };
    grants.put("ctr-1", &live).unwrap();
    claims.set(allocated("whole", "u-whole", "gpu-0", &[]));
    claims.set(allocated(
        "share",
        "u-share",
        "gpu-0",
        &[("cores", "30"), ("memory", "4Gi")],
    ));
    let mut client = DraPluginClient::new(channel(dir.path().join("plugins/gpu.tessera.io/dra.sock")).await);
    let mut got = HashMap::new();
    for _ in 0..50 {
        got = prepare(
            &mut client,
            &[claim_ref("whole", "u-whole"), claim_ref("share", "u-share")],
        )
        .await;
        if !got["u-whole"].error.contains("not read yet") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for uid in ["u-whole", "u-share"] {
        assert!(
            got[uid]
                .error
                .contains("in use by container main of pod team-b/trainer"),
            "{uid}: {}",
            got[uid].error
        );
        assert!(plugin.store().get(uid).unwrap().is_none());
    }
    // The container is gone (the NRI plugin removed its record): the card is prepared.
    grants.remove("ctr-1").unwrap();
    let got = prepare(&mut client, &[claim_ref("whole", "u-whole")]).await;
    assert_eq!(got["u-whole"].error, "");
    plugin.stop().await;
}

/// Creates instances in a fixture file, and fails to destroy them while `refuse_destroy`.
#[derive(Debug)]
struct Instances {
    inner: tessera_core::inventory::FixtureMigInstances,
    created: Mutex<usize>,
    refuse_destroy: std::sync::atomic::AtomicBool,
}

impl tessera_core::inventory::MigPartitioner for Instances {
    fn create(
        &self,
        parent_uuid: &str,
        profile_id: u32,
        placement: tessera_core::inventory::MigPlacement,
    ) -> Result<tessera_core::inventory::MadeInstance, tessera_core::inventory::MigError> {
        *self.created.lock().unwrap() += 1;
        self.inner.create(parent_uuid, profile_id, placement)
    }

    fn destroy(
        &self,
        parent_uuid: &str,
        gi: u32,
        uuid: &str,
        profile_id: u32,
        placement: tessera_core::inventory::MigPlacement,
    ) -> Result<(), tessera_core::inventory::MigError> {
        if self.refuse_destroy.load(std::sync::atomic::Ordering::Relaxed) {
            // As NVML refuses a GPU instance a process still uses (NVML_ERROR_IN_USE).
            return Err(tessera_core::inventory::MigError::Nvml {
                call: "nvmlGpuInstanceDestroy",
                message: "the card is busy".into(),
                rc: 19,
            });
        }
        self.inner.destroy(parent_uuid, gi, uuid, profile_id, placement)
    }
}

/// The MIG instances fixture file `path` has: (uuid, gi, placement start).
fn instances(path: &Path) -> Vec<(String, u32, u32)> {
    let inv = tessera_core::inventory::InventorySource::discover(&FixtureSource::new(path)).unwrap();
    inv.gpus
        .iter()
        .flat_map(|g| g.mig_devices.iter())
        .map(|m| (m.uuid.clone(), m.gi, m.placement.map_or(99, |p| p.start)))
        .collect()
}

/// Stands in for the CDI generator: lists the fixture's MIG instances as CDI devices.
fn cdi_generator(fixture: PathBuf, cdi: PathBuf) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let devices = instances(&fixture)
                .into_iter()
                .map(|(uuid, ..)| tessera_core::cdi::CdiDevice {
                    name: uuid,
                    annotations: Default::default(),
                    container_edits: Default::default(),
                })
                .collect();
            let spec = tessera_core::cdi::CdiSpec {
                cdi_version: "0.6.0".into(),
                kind: tessera_core::names::CDI_KIND.into(),
                devices,
                container_edits: Default::default(),
            };
            let _ = std::fs::create_dir_all(&cdi);
            let _ = std::fs::write(cdi.join("tessera.io-gpu.json"), serde_json::to_vec(&spec).unwrap());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// The fixture A100 node of dynamic MIG in `dir` (its file), and what makes its instances.
fn dynamic_mig_node(dir: &Path) -> (PathBuf, Arc<Instances>) {
    let fixture = dir.join("node.yaml");
    std::fs::write(
        &fixture,
        tessera_core::inventory::Fixture::builtin_text("a100-dynamic-mig").unwrap(),
    )
    .unwrap();
    let parts = Arc::new(Instances {
        inner: tessera_core::inventory::FixtureMigInstances::new(&fixture),
        created: Mutex::new(0),
        refuse_destroy: false.into(),
    });
    (fixture, parts)
}

/// Claim u-b, a 1g.5gb over memory slice 5 of card 0 where u-a's 3g.20gb at 4 is: refused
/// after waiting for u-a's unprepare (half the CDI wait), nothing more made.
async fn an_overlap_of_u_a_waits_and_is_refused(
    client: &mut DraPluginClient<Channel>,
    claims: &FakeClaims,
    parts: &Instances,
) {
    claims.set(allocated("b", "u-b", "gpu-0-mig-1g-5gb-at-5", &[]));
    let t = std::time::Instant::now();
    let got = prepare(client, &[claim_ref("b", "u-b")]).await;
    assert!(
        got["u-b"].error.contains("are taken by MIG instance"),
        "{}",
        got["u-b"].error
    );
    assert!(t.elapsed() >= Duration::from_millis(2400), "{:?}", t.elapsed());
    assert_eq!(*parts.created.lock().unwrap(), 1);
}

/// An instance made since the plugin last read the cards (another claim's prepare a moment
/// ago) is in the way of an overlapping placement like any other: the prepare waits for its
/// claim's unprepare and then refuses, rather than asking the card and failing at once.
#[tokio::test]
async fn an_instance_made_since_the_cards_were_read_is_seen_in_the_way() {
    let dir = tempfile::tempdir().unwrap();
    let (fixture, parts) = dynamic_mig_node(dir.path());
    let claims = Arc::new(FakeClaims::default());
    let generator = cdi_generator(fixture.clone(), dir.path().join("cdi"));
    // The cards are read once, as the plugin starts.
    let plugin = Plugin::start_polling(
        dir.path(),
        claims.clone(),
        &fixture,
        Some(parts.clone()),
        Duration::from_secs(3600),
    );
    let mut client = DraPluginClient::new(channel(dir.path().join("plugins/gpu.tessera.io/dra.sock")).await);
    claims.set(allocated("a", "u-a", "gpu-0-mig-3g-20gb-at-4", &[]));
    let mut got = prepare(&mut client, &[claim_ref("a", "u-a")]).await;
    for _ in 0..100 {
        if got["u-a"].error.is_empty() {
            break;
        }
        // The plugin's first reading of the cards may not be done yet.
        tokio::time::sleep(Duration::from_millis(50)).await;
        got = prepare(&mut client, &[claim_ref("a", "u-a")]).await;
    }
    assert_eq!(got["u-a"].error, "");
    an_overlap_of_u_a_waits_and_is_refused(&mut client, &claims, &parts).await;
    plugin.stop().await;
    generator.abort();
}

#[tokio::test]
async fn dynamic_mig_creates_an_instance_per_claim_and_destroys_it_when_done() {
    let dir = tempfile::tempdir().unwrap();
    let (fixture, parts) = dynamic_mig_node(dir.path());
    let claims = Arc::new(FakeClaims::default());
    let generator = cdi_generator(fixture.clone(), dir.path().join("cdi"));
    let plugin = Plugin::start_on(dir.path(), claims.clone(), &fixture, Some(parts.clone()));
    let endpoint = dir.path().join("plugins/gpu.tessera.io/dra.sock");
    let mut client = DraPluginClient::new(channel(endpoint.clone()).await);

    // A 3g.20gb at memory slice 4: created, recorded, and handed over once the CDI spec lists it.
    claims.set(allocated("a", "u-a", "gpu-0-mig-3g-20gb-at-4", &[]));
    let got = prepare(&mut client, &[claim_ref("a", "u-a")]).await;
    assert_eq!(got["u-a"].error, "");
    let made = instances(&fixture);
    assert_eq!(made.len(), 1);
    assert_eq!(made[0].2, 4);
    let record = plugin.store().get("u-a").unwrap().unwrap();
    let AllocatedDevice::Mig { uuid, gi, profile, .. } = &record.devices[0].allocated else {
        panic!("not a MIG device: {record:?}");
    };
    assert_eq!(
        (uuid, *gi, profile.to_string().as_str()),
        (&made[0].0, made[0].1, "3g.20gb")
    );
    assert!(record.devices[0].carved.is_some());
    // Asked again (the kubelet's retry): the same instance, none made.
    let again = prepare(&mut client, &[claim_ref("a", "u-a")]).await;
    assert_eq!(again["u-a"].error, "");
    assert_eq!(*parts.created.lock().unwrap(), 1);

    // A placement that overlaps it (a stale allocation): refused, nothing asked of the card,
    // nothing left.
    // It waited for u-a's unprepare first (half the CDI wait), in case the kubelet was about to.
    an_overlap_of_u_a_waits_and_is_refused(&mut client, &claims, &parts).await;
    assert_eq!(instances(&fixture).len(), 1);
    assert!(plugin.store().get("u-b").unwrap().is_none());
    assert!(dra::CarveLedger::new(&dir.path().join("state")).list().0.is_empty());

    // Two instances of which the card refuses the second: the first is destroyed again.
    let mut two = allocated("c", "u-c", "gpu-1-mig-4g-20gb-at-0", &[]);
    let results = two
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap();
    let mut second = results.results.as_ref().unwrap()[0].clone();
    second.device = "gpu-1-mig-1g-5gb-at-1".into();
    second.request = "second".into();
    results.results.as_mut().unwrap().push(second);
    claims.set(two);
    let got = prepare(&mut client, &[claim_ref("c", "u-c")]).await;
    assert!(
        got["u-c"].error.contains("gpu-1-mig-1g-5gb-at-1"),
        "{}",
        got["u-c"].error
    );
    assert_eq!(
        instances(&fixture),
        made,
        "the first instance of a failed prepare is destroyed"
    );
    assert!(dra::CarveLedger::new(&dir.path().join("state")).list().0.is_empty());

    // An operator's instance where an (older) allocation points: refused before anything is
    // written or made, and the operator's instance is left alone.
    let inv = tessera_core::inventory::InventorySource::discover(&FixtureSource::new(&fixture)).unwrap();
    let theirs = tessera_core::inventory::MigPartitioner::create(
        &parts.inner,
        &inv.gpus[1].uuid,
        19,
        tessera_core::inventory::MigPlacement { start: 6, size: 1 },
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    claims.set(allocated("d", "u-d", "gpu-1-mig-1g-5gb-at-6", &[]));
    let t = std::time::Instant::now();
    let got = prepare(&mut client, &[claim_ref("d", "u-d")]).await;
    assert!(
        got["u-d"].error.contains("are taken by MIG instance"),
        "{}",
        got["u-d"].error
    );
    // No claim holds it, so no unprepare will free it: refused without a wait.
    assert!(t.elapsed() < Duration::from_millis(2000), "{:?}", t.elapsed());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        instances(&fixture).iter().any(|(u, ..)| *u == theirs.uuid),
        "the operator's instance stays"
    );
    assert!(dra::CarveLedger::new(&dir.path().join("state")).list().0.is_empty());
    let inv = tessera_core::inventory::InventorySource::discover(&FixtureSource::new(&fixture)).unwrap();
    tessera_core::inventory::MigPartitioner::destroy(
        &parts.inner,
        &inv.gpus[1].uuid,
        theirs.gi,
        &theirs.uuid,
        19,
        tessera_core::inventory::MigPlacement { start: 6, size: 1 },
    )
    .unwrap();

    // A crash between creating an instance and recording its claim: the ledger names it, and
    // the next plugin destroys it (a claim it recorded keeps its own).
    let ledger = dra::CarveLedger::new(&dir.path().join("state"));
    plugin.stop().await;
    let gpu1 = FixtureSource::new(&fixture);
    let inv = tessera_core::inventory::InventorySource::discover(&gpu1).unwrap();
    let plan = dra::carve_of(&inv.gpus[1], "gpu-1-mig-7g-40gb-at-0").unwrap();
    ledger.add("u-crash", &plan, vec![]).unwrap();
    tessera_core::inventory::MigPartitioner::create(&parts.inner, &plan.parent_uuid, plan.profile_id, plan.placement)
        .unwrap();
    assert_eq!(instances(&fixture).len(), 2);
    // And an entry for the placement a recorded claim holds (a stale one): that instance stays.
    let held = dra::carve_of(&inv.gpus[0], "gpu-0-mig-3g-20gb-at-4").unwrap();
    ledger.add("u-stale", &held, vec![]).unwrap();
    let plugin = Plugin::start_on(dir.path(), claims.clone(), &fixture, Some(parts.clone()));
    for _ in 0..100 {
        if instances(&fixture).len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        instances(&fixture),
        made,
        "the unfinished prepare's instance is destroyed"
    );
    assert!(ledger.list().0.is_empty());

    // The card loses the instance (a reboot, a GPU reset) but the record stays: the kubelet's
    // prepare after the restart makes it again at its placement, records it, and answers once
    // the CDI spec lists it. Before, the prepare answered from the record and the container
    // waited for an instance that was gone.
    let lost = plugin.store().get("u-a").unwrap().unwrap();
    let AllocatedDevice::Mig {
        uuid: old_uuid,
        gi: old_gi,
        ..
    } = lost.devices[0].allocated.clone()
    else {
        panic!("not a MIG device: {lost:?}");
    };
    let plan = lost.devices[0].carved.clone().unwrap();
    tessera_core::inventory::MigPartitioner::destroy(
        &parts.inner,
        &plan.parent_uuid,
        old_gi,
        &old_uuid,
        plan.profile_id,
        plan.placement,
    )
    .unwrap();
    assert!(instances(&fixture).is_empty());
    let spec = dir.path().join("cdi/tessera.io-gpu.json");
    for _ in 0..100 {
        if !std::fs::read_to_string(&spec).unwrap_or_default().contains(&old_uuid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut client = DraPluginClient::new(channel(endpoint.clone()).await);
    let got = prepare(&mut client, &[claim_ref("a", "u-a")]).await;
    assert_eq!(got["u-a"].error, "");
    let now = instances(&fixture);
    assert_eq!(now.len(), 1);
    assert_eq!(now[0].2, 4, "made again at its placement");
    let record = plugin.store().get("u-a").unwrap().unwrap();
    assert!(
        matches!(&record.devices[0].allocated, AllocatedDevice::Mig { uuid, .. } if *uuid == now[0].0),
        "the record names the new instance: {record:?}"
    );
    assert!(ledger.list().0.is_empty());
    let made = now;

    // Unprepared: the instance goes with the record; while it cannot go, the record stays.
    let _ = &made;
    let unprepare = |uid: &str| api::NodeUnprepareResourcesRequest {
        claims: vec![claim_ref("a", uid)],
    };
    parts.refuse_destroy.store(true, std::sync::atomic::Ordering::Relaxed);
    let out = client
        .node_unprepare_resources(unprepare("u-a"))
        .await
        .unwrap()
        .into_inner();
    assert!(out.claims["u-a"].error.contains("the card is busy"), "{:?}", out.claims);
    assert!(plugin.store().get("u-a").unwrap().is_some());
    parts.refuse_destroy.store(false, std::sync::atomic::Ordering::Relaxed);
    let out = client
        .node_unprepare_resources(unprepare("u-a"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.claims["u-a"].error, "");
    assert!(instances(&fixture).is_empty());
    assert!(plugin.store().get("u-a").unwrap().is_none());

    // A claim allocated slices that a claim still prepared holds (its pod was deleted, the
    // scheduler gave its slices away, the kubelet has not unprepared it yet): the prepare waits
    // for that unprepare and gets its instance, rather than failing into the kubelet's
    // back-off (seen: over 90 s on the real cluster).
    claims.set(allocated("f", "u-f", "gpu-0-mig-3g-20gb-at-4", &[]));
    assert_eq!(prepare(&mut client, &[claim_ref("f", "u-f")]).await["u-f"].error, "");
    claims.set(allocated("g", "u-g", "gpu-0-mig-1g-5gb-at-5", &[]));
    let mut kubelet = DraPluginClient::new(channel(endpoint.clone()).await);
    let t = std::time::Instant::now();
    let unprepared = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        kubelet
            .node_unprepare_resources(unprepare("u-f"))
            .await
            .unwrap()
            .into_inner()
    });
    let got = prepare(&mut client, &[claim_ref("g", "u-g")]).await;
    assert_eq!(got["u-g"].error, "");
    assert!(t.elapsed() >= Duration::from_millis(800), "{:?}", t.elapsed());
    assert_eq!(unprepared.await.unwrap().claims["u-f"].error, "");
    let now = instances(&fixture);
    assert_eq!((now.len(), now[0].2), (1, 5), "{now:?}");
    assert!(plugin.store().get("u-g").unwrap().is_some());
    plugin.stop().await;
    generator.abort();
}
