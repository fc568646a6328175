//! A stand-in for the MPS supervisor, for tests of what the NRI plugin holds on MPS nodes
//! without a daemon: every card's daemon ready, holding the ceiling the plugin wants.

use std::time::Duration;

use tessera_core::enforcement::{DaemonPhase, MpsCeiling, MpsLayout, MpsState, unix_secs};

/// Each of `cards`' daemon ready, holding the ceiling the plugin wants (none written: closed),
/// with the directories a share device mounts: what the supervisor does for a card.
pub fn hold_wanted_ceilings<'a>(layout: &MpsLayout, cards: impl IntoIterator<Item = &'a str>) -> std::io::Result<()> {
    for uuid in cards {
        for dir in [layout.client_dir(uuid), layout.shm_dir(uuid)] {
            std::fs::create_dir_all(dir)?;
        }
        let now = unix_secs(std::time::SystemTime::now());
        let state = MpsState {
            phase: DaemonPhase::Ready,
            pid: Some(1),
            restarts: 0,
            started_at: now,
            checked_at: now,
            reason: None,
            ceiling: Some(layout.read_ceiling(uuid).ok().flatten().unwrap_or(MpsCeiling::CLOSED)),
            // A stand-in daemon: the card's mode is not read.
            exclusive_process: None,
        };
        layout.write_state(uuid, &state)?;
    }
    Ok(())
}

/// Keeps [`hold_wanted_ceilings`] true for `cards` (within 20 ms of a change), until the
/// returned sender is dropped.
pub fn stand_in_daemons(layout: MpsLayout, cards: Vec<String>) -> std::sync::mpsc::Sender<()> {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_millis(20)) {
            let _ = hold_wanted_ceilings(&layout, cards.iter().map(String::as_str));
        }
    });
    tx
}

/// Installs a stand-in for Tessera's CUDA hook under `layout` (MPS nodes preload it into share
/// containers): an empty shared object, which every process loads and which holds nothing. For
/// tests of what MPS nodes do beside the hook; the hook's own are in `hook/tests`.
pub fn install_placeholder_hook(layout: &tessera_core::enforcement::HookLayout) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (src, lib) = (dir.path().join("empty.c"), dir.path().join("libempty.so"));
    std::fs::write(&src, "/* a preloaded library that does nothing */\n")?;
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()?;
    anyhow::ensure!(built.success(), "cc could not build an empty shared object");
    layout.install(&lib)?;
    Ok(())
}
