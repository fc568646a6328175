//! Windows of a card's time for hook nodes' shares, as the plugin gives them.

use tessera_core::enforcement::{HookLayout, ShareEnforcement};
use tessera_core::handoff::AllocatedDevice;

use crate::plugin::tests::Node;

/// The `window=` line of container `id`'s hook configuration.
fn window_line(hook: &HookLayout, id: &str) -> Option<String> {
    let text = std::fs::read_to_string(hook.container_dir(id).join("config")).unwrap();
    assert!(
        text.lines().any(|l| l == "compute=windows") == text.contains("window="),
        "{text}"
    );
    text.lines().find_map(|l| l.strip_prefix("window=")).map(str::to_string)
}

/// Shares of one card on a hook node get windows of its time that do not overlap; a share on
/// another card has its own card's time; a window freed by a stopped container is given again.
#[tokio::test]
async fn shares_of_a_card_get_windows_that_do_not_overlap() {
    let node = Node::new();
    let hook = node.hook_installed();
    let plugin = node.plugin(ShareEnforcement::Hook);
    let gpus = &node.inv.gpus;
    let run = |plugin: &crate::plugin::TesseraPlugin, name: &str, device| {
        let (pod, ctr) = node.signed(name, device, &[]);
        plugin.adjust(&pod, &ctr).unwrap();
        window_line(&hook, &ctr.id)
    };
    assert_eq!(
        run(&plugin, "a", AllocatedDevice::share(&gpus[0], 30, 4096)).as_deref(),
        Some("0-30")
    );
    assert_eq!(
        run(&plugin, "b", AllocatedDevice::share(&gpus[0], 50, 4096)).as_deref(),
        Some("30-80")
    );
    assert_eq!(
        run(&plugin, "c", AllocatedDevice::share(&gpus[1], 40, 4096)).as_deref(),
        Some("0-40")
    );
    plugin.stopped("ctr-a");
    assert_eq!(
        run(&plugin, "d", AllocatedDevice::share(&gpus[0], 20, 4096)).as_deref(),
        Some("0-20")
    );
    assert_eq!(
        run(&plugin, "e", AllocatedDevice::share(&gpus[0], 20, 4096)).as_deref(),
        Some("80-100")
    );
    // What the books hold is what the configurations say.
    let held = plugin.tracked();
    assert_eq!(held["ctr-b"].window.as_ref().unwrap().window.to_string(), "30-80");
    assert!(held["ctr-a"].stopped);

    // A restarted plugin, with the grant records or without them (then from the hook
    // configurations), gives no other share the time of those still running.
    let live: Vec<_> = ["b", "d", "e"]
        .iter()
        .map(|n| node.signed(n, AllocatedDevice::share(&gpus[0], 20, 4096), &[]))
        .collect();
    let (pods, ctrs): (Vec<_>, Vec<_>) = live.into_iter().unzip();
    for records in [true, false] {
        if !records {
            std::fs::remove_dir_all(node.dir.path().join("grants")).unwrap();
        }
        let restarted = node.plugin(ShareEnforcement::Hook);
        restarted.rebuild(&pods, &ctrs);
        assert_eq!(
            run(&restarted, "f", AllocatedDevice::share(&gpus[0], 10, 4096)).as_deref(),
            Some("20-30"),
            "records kept: {records}"
        );
    }
}
