use super::*;
use std::collections::BTreeMap;

use tessera_core::enforcement::DEFAULT_MPS_ROOT;

fn deploy_file(name: &str) -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn the_checked_in_manifests_are_the_default_rendering() {
    let rendered = render(&ManifestOptions::default());
    assert!(
        deploy_file("tessera.yaml") == rendered,
        "deploy/tessera.yaml drifted from the renderer; run\n  \
         cargo run -p tessera-deploy -- --out deploy/tessera.yaml"
    );
    assert!(
        deploy_file("scheduler-config.yaml") == scheduler_config(&ManifestOptions::default()),
        "deploy/scheduler-config.yaml drifted; run\n  \
         cargo run -p tessera-deploy -- --scheduler-config --out deploy/scheduler-config.yaml"
    );
}

#[test]
fn the_checked_in_chart_is_the_default_rendering() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("chart/tessera");
    let rerender = "deploy/chart/tessera drifted from the renderer; run\n  \
                    cargo run -p tessera-deploy -- --helm-chart deploy/chart/tessera";
    let files = chart::files(&ManifestOptions::default());
    for (path, text) in &files {
        assert!(
            deploy_file(&format!("chart/tessera/{path}")) == *text,
            "{path}: {rerender}"
        );
    }
    // And nothing else there.
    let mut on_disk = Vec::new();
    for sub in ["", "templates", "crds"] {
        for entry in std::fs::read_dir(dir.join(sub)).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                on_disk.push(format!(
                    "{}{}",
                    if sub.is_empty() {
                        String::new()
                    } else {
                        format!("{sub}/")
                    },
                    entry.file_name().to_string_lossy()
                ));
            }
        }
    }
    on_disk.sort();
    let mut want: Vec<String> = files.into_iter().map(|(p, _)| p).collect();
    want.sort();
    assert_eq!(on_disk, want, "{rerender}");
}

#[test]
fn objects_are_complete_and_namespaced() {
    let opts = ManifestOptions {
        namespace: "gpu".into(),
        ..Default::default()
    };
    let objs = objects(&opts);
    let cluster_scoped = [
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "MutatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    for o in &objs {
        let kind = o["kind"].as_str().expect("kind");
        assert!(o["apiVersion"].is_string(), "{o}");
        let ns = o["metadata"]["namespace"].as_str();
        if cluster_scoped.contains(&kind) {
            assert_eq!(ns, None, "{kind} is cluster-scoped");
        } else if o["metadata"]["name"] != "tessera-scheduler-auth-reader" {
            assert_eq!(ns, Some("gpu"), "{kind} {}", o["metadata"]["name"]);
        }
    }
    // Round trip through YAML, as kubectl reads it.
    let docs: Vec<serde_json::Value> = render(&opts)
        .split("\n---\n")
        .skip(1)
        .map(|d| serde_yaml::from_str(d).unwrap())
        .collect();
    assert_eq!(docs, objs);
}

#[test]
fn rbac_is_least_privilege() {
    for o in objects(&ManifestOptions::default()) {
        if !matches!(o["kind"].as_str(), Some("ClusterRole" | "Role")) {
            continue;
        }
        for r in o["rules"].as_array().unwrap() {
            let verbs: Vec<&str> = r["verbs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            let res: Vec<&str> = r["resources"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert!(!verbs.contains(&"*") && !res.contains(&"*"), "{o}");
            // The only Secrets read through the API are the certificates the extender keeps
            // (the webhook's, its side of the verbs'), by name, in its own namespace (creating
            // them cannot be limited by name); the scheduler's side is written, never read.
            if res.contains(&"secrets") {
                assert_eq!((o["kind"].as_str(), res.len()), (Some("Role"), 1), "{o}");
                let named = |names: &[&str]| r["resourceNames"] == serde_json::json!(names);
                assert!(
                    verbs == ["get", "list", "watch"] && named(&[claims::WEBHOOK_SECRET, EXTENDER_TLS_SECRET])
                        || verbs == ["patch", "delete"] && named(&[EXTENDER_TLS_SECRET])
                        || verbs == ["update"] && named(&[SCHEDULER_TLS_SECRET])
                        || verbs == ["create"],
                    "{r}"
                );
            }
            // The only deletions: ElasticGPUs of a Delete class whose pod is gone, and the
            // verbs' certificates the extender makes again (by name).
            if verbs.contains(&"delete") {
                assert!(
                    res == ["elasticgpus"]
                        || res == ["secrets"] && r["resourceNames"] == serde_json::json!([EXTENDER_TLS_SECRET]),
                    "{o}"
                );
            }
            if res.contains(&"mutatingwebhookconfigurations") {
                assert_eq!(r["resourceNames"], serde_json::json!([claims::WEBHOOK_CONFIGURATION]));
            }
        }
    }
}

#[test]
fn the_node_agents_mount_the_nri_directory_not_the_socket() {
    let ds = objects(&ManifestOptions::default())
        .into_iter()
        .find(|o| o["kind"] == "DaemonSet")
        .unwrap();
    let vols = ds["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    let nri = vols.iter().find(|v| v["name"] == "nri").unwrap();
    assert_eq!(nri["hostPath"]["path"], "/var/run/nri");
    assert_eq!(nri["hostPath"]["type"], "DirectoryOrCreate");
    let paths: Vec<&str> = vols.iter().filter_map(|v| v["hostPath"]["path"].as_str()).collect();
    for p in ["/var/run/cdi", "/var/lib/kubelet/device-plugins", "/dev"] {
        assert!(paths.contains(&p), "{paths:?}");
    }
}

/// Nodes whose runtime keeps its NRI socket and CDI specs elsewhere: the DaemonSet mounts
/// those host paths, and the plugin connects to the socket by its name.
#[test]
fn runtime_paths_are_options() {
    let ds = objects(&ManifestOptions {
        nri_socket: "/run/containerd/nri/tessera.sock".into(),
        cdi_dir: "/etc/cdi".into(),
        ..Default::default()
    })
    .into_iter()
    .find(|o| o["kind"] == "DaemonSet")
    .unwrap();
    let spec = &ds["spec"]["template"]["spec"];
    let host = |name: &str| {
        spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap()["hostPath"]["path"]
            .clone()
    };
    assert_eq!(host("nri"), "/run/containerd/nri");
    assert_eq!(host("cdi"), "/etc/cdi");
    let nri = spec["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "nri-plugin")
        .unwrap();
    assert!(
        nri["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--socket=/var/run/nri/tessera.sock")
    );
}

/// Deleting the manifests keeps the namespace, and with it the hand-off key Secret.
#[test]
fn the_manifests_do_not_own_the_namespace() {
    assert!(
        !objects(&ManifestOptions::default())
            .iter()
            .any(|o| o["kind"] == "Namespace")
    );
}

#[test]
fn the_scheduler_config_names_the_extender_and_every_resource() {
    let cfg: serde_json::Value = serde_yaml::from_str(&scheduler_config(&ManifestOptions::default())).unwrap();
    assert_eq!(cfg["apiVersion"], "kubescheduler.config.k8s.io/v1");
    // Every node looked at for each pod (tests/tests/scheduler_sampling.rs shows why).
    assert_eq!(cfg["profiles"][0]["percentageOfNodesToScore"], 100);
    let ext = &cfg["extenders"][0];
    // HTTPS, and the scheduler's client certificate: the verbs answer no one else.
    assert_eq!(
        ext["urlPrefix"],
        "https://tessera-extender.tessera-system.svc:8888/tessera"
    );
    let tls = &ext["tlsConfig"];
    assert_eq!(tls["serverName"], "tessera-extender.tessera-system.svc");
    for (k, file) in [("caFile", "ca.crt"), ("certFile", "tls.crt"), ("keyFile", "tls.key")] {
        assert_eq!(tls[k], format!("/etc/tessera/extender-client/{file}"));
    }
    assert_eq!(ext["bindVerb"], "bind");
    assert_eq!(ext["nodeCacheCapable"], true);
    let names: Vec<&str> = ext["managedResources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"tessera.io/gpu-core") && names.contains(&"tessera.io/mig-1g.5gb"));
    for n in names.iter().filter(|n| n.starts_with("tessera.io/mig-")) {
        assert!(
            matches!(tessera_core::mig::MigProfile::from_resource_name(n), Some(Ok(_))),
            "{n} is not a MIG resource name the device plugin would advertise"
        );
    }
}

/// Only the extender can sign: it alone mounts the private keys; every node agent mounts the
/// public ones.
#[test]
fn only_the_extender_mounts_the_signing_keys() {
    let objs = objects(&ManifestOptions::default());
    let secrets_of = |kind: &str, name: &str| -> Vec<String> {
        let o = objs
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{kind} {name}"));
        o["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["secret"]["secretName"].as_str().map(String::from))
            .collect()
    };
    assert!(secrets_of("Deployment", EXTENDER).contains(&KEYS_SECRET.to_string()));
    let node = secrets_of("DaemonSet", NODE);
    assert!(node.contains(&PUBLIC_KEYS_SECRET.to_string()), "{node:?}");
    assert!(!node.contains(&KEYS_SECRET.to_string()), "{node:?}");
    assert!(!secrets_of("Deployment", SCHEDULER).contains(&KEYS_SECRET.to_string()));
    // Each side of the verbs' TLS mounts only its own key's Secret.
    assert_eq!(secrets_of("Deployment", SCHEDULER), [SCHEDULER_TLS_SECRET]);
    assert!(!secrets_of("Deployment", EXTENDER).contains(&SCHEDULER_TLS_SECRET.to_string()));
}

/// Every directory a node agent writes is mounted read-write in its container, and what it only
/// reads is read-only: the NRI plugin writes each card's MPS ceiling (a read-only mount made
/// every MPS share fail at creation, waiting for a ceiling that was never written) and its
/// grant records; the DRA plugin reads those records and writes the claims' records.
#[test]
fn node_agents_can_write_where_they_write_and_only_there() {
    let opts = ManifestOptions {
        dra: true,
        ..Default::default()
    };
    let objs = objects(&opts);
    let node = objs
        .iter()
        .find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == NODE)
        .unwrap();
    let mounts = |container: &str| -> BTreeMap<String, bool> {
        node["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == container)
            .unwrap_or_else(|| panic!("container {container}"))["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["mountPath"].as_str().unwrap().to_string(),
                    m["readOnly"].as_bool().unwrap_or(false),
                )
            })
            .collect()
    };
    let grants = tessera_core::granted::DEFAULT_GRANTS_DIR;
    let dra_state = tessera_core::dra::DEFAULT_STATE_DIR;
    for (container, path, read_only) in [
        ("nri-plugin", DEFAULT_MPS_ROOT, false),
        ("nri-plugin", grants, false),
        ("nri-plugin", dra_state, true),
        ("nri-plugin", "/etc/tessera/keys", true),
        ("dra-plugin", grants, true),
        ("dra-plugin", dra_state, false),
        ("dra-plugin", "/var/run/cdi", false),
        ("mps-supervisor", DEFAULT_MPS_ROOT, false),
    ] {
        assert_eq!(
            mounts(container).get(path),
            Some(&read_only),
            "{container} mounts {path} read-only: {read_only}"
        );
    }
}

/// Every program a container of the manifests runs (DRA and MPS included) is one the image
/// ships (scripts/ship.sh), and the DRA install adds the plugin to the node DaemonSet, its
/// classes and its rights, and nothing to an install without it.
#[test]
fn every_container_runs_a_shipped_binary_and_dra_is_only_there_when_asked() {
    let ship = deploy_file("../scripts/ship.sh");
    let shipped: Vec<&str> = ship
        .lines()
        .find_map(|l| l.strip_prefix("bins=("))
        .and_then(|l| l.strip_suffix(')'))
        .expect("ship.sh names its binaries")
        .split_whitespace()
        .collect();
    let dra = ManifestOptions {
        dra: true,
        ..Default::default()
    };
    let objs = objects(&dra);
    let mut programs = Vec::new();
    for o in &objs {
        for c in o["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(p) = c["command"][0].as_str() {
                programs.push(p.to_string());
            }
        }
    }
    assert!(programs.iter().any(|p| p == "tessera-dra-plugin"), "{programs:?}");
    for p in programs.iter().filter(|p| p.starts_with("tessera-")) {
        assert!(
            shipped.contains(&p.as_str()),
            "{p} is run but not shipped ({shipped:?})"
        );
    }
    let kinds = |objs: &[serde_json::Value]| -> Vec<String> {
        objs.iter()
            .map(|o| o["kind"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(kinds(&objs).iter().filter(|k| *k == "DeviceClass").count(), 3);
    let plain = objects(&ManifestOptions::default());
    assert!(!kinds(&plain).iter().any(|k| k == "DeviceClass"));
    assert!(!render(&ManifestOptions::default()).contains("dra"));
}

/// The extender's verbs are reachable only from the `tessera` scheduler's pods, its webhook from
/// anywhere: the policy selects exactly the extender's pods, names the ports its container
/// serves, and lets in on the verbs' port only pods the scheduler's Deployment makes.
#[test]
fn only_the_scheduler_reaches_the_extenders_verbs() {
    let objs = objects(&ManifestOptions::default());
    let find = |kind: &str, name: &str| {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    let matches = |selector: &serde_json::Value, labels: &serde_json::Value| {
        selector["matchLabels"]
            .as_object()
            .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels[k] == *v))
    };
    let policy = find("NetworkPolicy", EXTENDER);
    let spec = &policy["spec"];
    let extender_pods = &find("Deployment", EXTENDER)["spec"]["template"]["metadata"]["labels"];
    let scheduler_pods = &find("Deployment", SCHEDULER)["spec"]["template"]["metadata"]["labels"];
    assert!(matches(&spec["podSelector"], extender_pods), "{policy}");
    assert!(!matches(&spec["podSelector"], scheduler_pods), "{policy}");
    assert_eq!(spec["policyTypes"], serde_json::json!(["Ingress"]));
    let ports: Vec<i64> = find("Deployment", EXTENDER)["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_i64().unwrap())
        .collect();
    assert_eq!(ports, [i64::from(EXTENDER_PORT), i64::from(claims::WEBHOOK_PORT)]);
    let rules = spec["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{policy}");
    let port_of = |r: &serde_json::Value| r["ports"][0]["port"].as_i64().unwrap();
    let verbs = rules.iter().find(|r| port_of(r) == i64::from(EXTENDER_PORT)).unwrap();
    let peers = verbs["from"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{verbs}");
    assert!(matches(&peers[0]["podSelector"], scheduler_pods), "{verbs}");
    assert!(!matches(&peers[0]["podSelector"], extender_pods), "{verbs}");
    assert!(
        peers[0].get("namespaceSelector").is_none(),
        "only this namespace's scheduler: {verbs}"
    );
    let webhook = rules
        .iter()
        .find(|r| port_of(r) == i64::from(claims::WEBHOOK_PORT))
        .unwrap();
    assert!(
        webhook.get("from").is_none(),
        "the API server calls from outside the pod network: {webhook}"
    );
}
