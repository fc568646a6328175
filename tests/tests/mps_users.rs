//! MPS serves one user per card, held at the real runtimes (containerd 1.7 and 2.x): an MPS
//! share whose process starts as another user than the card's live shares is refused at start,
//! with the reason in the runtime's error; one of the same user starts. The card's daemon is a
//! stand-in here (a loop that holds whatever ceiling is wanted, as the supervisor does): the
//! rule is the NRI plugin's, read off the starting process in /proc, and involves no daemon.

use std::sync::Arc;
use std::time::Duration;

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::enforcement::{HookLayout, MpsLayout, ShareEnforcement};
use tessera_core::handoff::{AllocatedDevice, SigningKeys};
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin};
use tessera_nri_plugin::session::{self, Identity};
use tessera_tests::containerd::{ContainerSpec, Containerd, Pod, Version};
use tessera_tests::fake_node::fake_node;

const NODE: &str = "node-users";

async fn pod(c: &mut Containerd, keys: &SigningKeys, name: &str, device: AllocatedDevice) -> anyhow::Result<Pod> {
    c.run_signed_pod(keys, NODE, name, device).await
}

/// A 20% + 4 GiB share container running as `uid`, waiting.
fn share(uid: i64) -> ContainerSpec {
    ContainerSpec::new("main", &["sh", "-c", "sleep 600"])
        .annotation("tessera.io/allocated.gpu-core", "20")
        .annotation("tessera.io/allocated.gpu-memory", "4")
        .annotation("tessera.io/allocated.gpu-memory-mib", "4096")
        .user(uid)
}

async fn one_user_per_card(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let root = tempfile::tempdir()?;
    let inv = fake_node("h100x8", root.path())?;
    let layout = MpsLayout::new(root.path().join("mps"));
    let hook = HookLayout::new(root.path().join("hook"));
    tessera_tests::mps::install_placeholder_hook(&hook)?;
    let opts = SpecOptions {
        dev_root: root.path().join("host"),
        enforcement: ShareEnforcement::Mps,
        mps: layout.clone(),
        hook: hook.clone(),
        ..Default::default()
    };
    write_spec(&c.cdi_dir(), SPEC_FILE, &spec::render(&inv, &opts)?.1)?;
    let _daemons =
        tessera_tests::mps::stand_in_daemons(layout.clone(), inv.gpus.iter().map(|g| g.uuid.clone()).collect());
    let keys = SigningKeys::new("k1", [("k1".to_string(), vec![5u8; 32])])?;
    let plugin = Arc::new(TesseraPlugin::new(PluginConfig {
        node: NODE.into(),
        keys: keys.verifying(),
        cdi_dirs: vec![c.cdi_dir()],
        enforcement: ShareEnforcement::Mps,
        mps: layout.clone(),
        hook,
        claims: Default::default(),
    }));
    let mut synced = plugin.synchronized();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let id = Identity {
        name: "tessera".into(),
        idx: "10".into(),
    };
    let task = tokio::spawn(session::run_external(c.nri_socket(), id, plugin.clone(), async move {
        let _ = stop_rx.await;
    }));
    tokio::time::timeout(Duration::from_secs(15), synced.wait_for(|n| *n > 0)).await??;
    let card = AllocatedDevice::share(&inv.gpus[0], 20, 4096);

    // The card's first share runs as root.
    let first = pod(&mut c, &keys, "first", card.clone()).await?;
    let cid = c.create_container(&first, share(0)).await?;
    c.start_container(&cid).await?;
    // Another image's user (1000): refused at start, naming the share it would hold up.
    let other = pod(&mut c, &keys, "other", card.clone()).await?;
    let cid = c.create_container(&other, share(1000)).await?;
    let err = format!("{:#}", c.start_container(&cid).await.unwrap_err());
    assert!(
        err.contains("runs as uid 1000") && err.contains("serves uid 0") && err.contains("pod default/first"),
        "{err}"
    );
    // The same user: starts beside it.
    let same = pod(&mut c, &keys, "same", card.clone()).await?;
    let cid = c.create_container(&same, share(0)).await?;
    c.start_container(&cid).await?;
    // On another card, user 1000 is the first: it starts.
    let elsewhere = pod(
        &mut c,
        &keys,
        "elsewhere",
        AllocatedDevice::share(&inv.gpus[1], 20, 4096),
    )
    .await?;
    let cid = c.create_container(&elsewhere, share(1000)).await?;
    c.start_container(&cid).await?;
    assert_eq!(plugin.tracked()[&cid].user, Some(1000));
    let _ = stop_tx.send(());
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_per_card_on_containerd_1_7() -> anyhow::Result<()> {
    one_user_per_card(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_per_card_on_containerd_2() -> anyhow::Result<()> {
    one_user_per_card(Version::V2).await
}
