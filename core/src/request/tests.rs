use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use proptest::prelude::*;

use super::*;

fn res(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, Quantity>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
            .collect(),
    )
}

fn container(name: &str, limits: &[(&str, &str)]) -> Container {
    Container {
        name: name.into(),
        resources: Some(ResourceRequirements {
            limits: res(limits),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pod(containers: Vec<Container>, annotations: &[(&str, &str)]) -> Pod {
    let mut p = Pod {
        spec: Some(PodSpec {
            containers,
            ..Default::default()
        }),
        ..Default::default()
    };
    p.metadata.annotations = Some(
        annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    p
}

fn parse(containers: Vec<Container>) -> Result<PodRequest, RequestError> {
    PodRequest::from_pod(&pod(containers, &[]), &RequestOptions::default())
}

fn gpu_of(limits: &[(&str, &str)]) -> Result<GpuDemand, RequestError> {
    parse(vec![container("main", limits)]).map(|r| r.containers[0].gpu.clone())
}

#[test]
fn shares_whole_cards_and_mig() {
    assert_eq!(
        gpu_of(&[("tessera.io/gpu-core", "30"), ("tessera.io/gpu-memory", "8")]).unwrap(),
        GpuDemand::Share(GpuShare {
            core_percent: 30,
            memory_mib: Some(8 * 1024)
        })
    );
    assert_eq!(
        gpu_of(&[("tessera.io/gpu-core", "50")]).unwrap(),
        GpuDemand::Share(GpuShare {
            core_percent: 50,
            memory_mib: None
        })
    );
    assert_eq!(
        gpu_of(&[("tessera.io/gpu-memory", "4")]).unwrap(),
        GpuDemand::Share(GpuShare {
            core_percent: 0,
            memory_mib: Some(4096)
        })
    );
    assert_eq!(
        gpu_of(&[("tessera.io/gpu-core", "200")]).unwrap(),
        GpuDemand::Whole {
            cards: 2,
            min_memory_mib: None
        }
    );
    assert_eq!(
        gpu_of(&[("tessera.io/mig-1g.10gb", "2")]).unwrap(),
        GpuDemand::Mig(vec![MigDemand {
            profile: "1g.10gb".parse().unwrap(),
            count: 2
        }])
    );
    assert_eq!(gpu_of(&[("cpu", "1")]).unwrap(), GpuDemand::None);
    assert_eq!(gpu_of(&[("tessera.io/gpu-core", "0")]).unwrap(), GpuDemand::None);
}

#[test]
fn memory_unit_is_a_setting() {
    let opts = RequestOptions { memory_unit_mib: 256 };
    let r = PodRequest::from_pod(
        &pod(vec![container("c", &[("tessera.io/gpu-memory", "3")])], &[]),
        &opts,
    )
    .unwrap();
    assert_eq!(
        r.containers[0].gpu,
        GpuDemand::Share(GpuShare {
            core_percent: 0,
            memory_mib: Some(768)
        })
    );
}

#[test]
fn errors_name_container_resource_and_value() {
    let e = gpu_of(&[("tessera.io/gpu-core", "150")]).unwrap_err();
    assert_eq!(
        e,
        RequestError::CoreOutOfRange {
            container: "main".into(),
            value: 150
        }
    );
    let msg = e.to_string();
    assert!(
        msg.contains("\"main\"") && msg.contains("tessera.io/gpu-core=150"),
        "{msg}"
    );

    let e = gpu_of(&[("tessera.io/gpu-core", "1.5")]).unwrap_err();
    assert!(
        matches!(&e, RequestError::NotWhole { value, .. } if value == "1.5"),
        "{e}"
    );
    let e = gpu_of(&[("tessera.io/gpu-core", "lots")]).unwrap_err();
    assert!(
        matches!(&e, RequestError::Quantity { resource, value, .. } if resource == "tessera.io/gpu-core" && value == "lots")
    );
    let e = gpu_of(&[("tessera.io/gpu", "1")]).unwrap_err();
    assert!(matches!(&e, RequestError::UnknownResource { resource, .. } if resource == "tessera.io/gpu"));
    let e = gpu_of(&[("tessera.io/mig-1g.10gb", "1"), ("tessera.io/gpu-core", "10")]).unwrap_err();
    assert!(
        matches!(&e, RequestError::Conflict { other, .. } if other == "tessera.io/gpu-core"),
        "{e}"
    );
    let e = gpu_of(&[("tessera.io/mig-big", "1")]).unwrap_err();
    assert!(matches!(&e, RequestError::BadMigProfile { resource, .. } if resource == "tessera.io/mig-big"));
    let e = gpu_of(&[("tessera.io/gpu-memory", "99999999999999999")]).unwrap_err();
    assert!(matches!(&e, RequestError::TooLarge { .. }), "{e}");
}

#[test]
fn requests_and_limits_must_agree_for_extended_resources() {
    let mut c = container("main", &[("tessera.io/gpu-core", "20")]);
    c.resources.as_mut().unwrap().requests = res(&[("tessera.io/gpu-core", "30")]);
    let e = parse(vec![c]).unwrap_err();
    assert!(matches!(e, RequestError::RequestLimitMismatch { .. }), "{e}");

    // Requests alone are enough; limits alone are enough.
    let mut c = Container {
        name: "r".into(),
        ..Default::default()
    };
    c.resources = Some(ResourceRequirements {
        requests: res(&[("tessera.io/gpu-core", "20"), ("cpu", "250m")]),
        ..Default::default()
    });
    let r = parse(vec![c]).unwrap();
    assert_eq!(r.containers[0].cpu_milli, 250);
    assert!(r.wants_gpu());
}

#[test]
fn cpu_and_memory_prefer_requests_over_limits() {
    let mut c = container("main", &[("cpu", "2"), ("memory", "2Gi")]);
    c.resources.as_mut().unwrap().requests = res(&[("cpu", "500m"), ("memory", "1Gi")]);
    let r = parse(vec![c]).unwrap();
    assert_eq!(
        (r.containers[0].cpu_milli, r.containers[0].memory_bytes),
        (500, 1 << 30)
    );
    // Limits only: requests default to limits.
    let r = parse(vec![container("main", &[("cpu", "2")])]).unwrap();
    assert_eq!(r.containers[0].cpu_milli, 2000);
}

#[test]
fn effective_request_follows_kubernetes_init_rule() {
    let mut p = pod(
        vec![container("a", &[("cpu", "1")]), container("b", &[("cpu", "1")])],
        &[],
    );
    let spec = p.spec.as_mut().unwrap();
    spec.init_containers = Some(vec![
        container("init-big", &[("cpu", "3"), ("tessera.io/gpu-core", "100")]),
        Container {
            restart_policy: Some("Always".into()),
            ..container("sidecar", &[("cpu", "500m")])
        },
        container("init-small", &[("cpu", "2")]),
    ]);
    spec.overhead = Some(res(&[("cpu", "100m")]).unwrap());
    let r = PodRequest::from_pod(&p, &RequestOptions::default()).unwrap();
    let roles: Vec<_> = r.containers.iter().map(|c| c.role).collect();
    assert_eq!(
        roles,
        [
            ContainerRole::Init,
            ContainerRole::Sidecar,
            ContainerRole::Init,
            ContainerRole::App,
            ContainerRole::App
        ]
    );
    assert_eq!(r.phases(), vec![vec![0], vec![1, 2], vec![1, 3, 4]]);
    // max(3, 0.5 + 2, 0.5 + 1 + 1) + overhead
    assert_eq!(r.effective_cpu_milli(), 3100);
    assert!(r.wants_gpu());
}

#[test]
fn annotations() {
    let c = || vec![container("main", &[("tessera.io/gpu-core", "50")])];
    let opts = RequestOptions::default();
    let r = PodRequest::from_pod(
        &pod(
            c(),
            &[
                ("tessera.io/gpu-model", "A100-SXM4-40GB | H100"),
                ("tessera.io/core-limit", "80"),
                ("tessera.io/node-policy", "spread"),
                ("tessera.io/gpu-policy", "fgd"),
                ("tessera.io/gpu-link", "NVLink"),
            ],
        ),
        &opts,
    )
    .unwrap();
    assert_eq!(r.gpu_link, Some(crate::topology::LinkRequirement::Nvlink));
    assert_eq!(
        r.gpu_models,
        Some(vec!["A100-SXM4-40GB".to_string(), "H100".to_string()])
    );
    assert_eq!(r.core_limit, Some(80));
    assert_eq!(r.node_policy, Some(PolicyKind::Spread));
    assert_eq!(r.gpu_policy, Some(PolicyKind::Fgd));

    for (k, v) in [
        ("tessera.io/core-limit", "40"),
        ("tessera.io/core-limit", "101"),
        ("tessera.io/core-limit", "x"),
        ("tessera.io/gpu-model", " | "),
        ("tessera.io/node-policy", "packing"),
        ("tessera.io/gpu-link", "infiniband"),
    ] {
        let e = PodRequest::from_pod(&pod(c(), &[(k, v)]), &opts).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(k) && msg.contains(v), "{msg}");
    }
}

#[test]
fn share_memory_defaults_to_core_proportion() {
    let s = GpuShare {
        core_percent: 25,
        memory_mib: None,
    };
    assert_eq!(s.memory_on(80 * 1024), 20 * 1024);
    let s = GpuShare {
        core_percent: 25,
        memory_mib: Some(1000),
    };
    assert_eq!(s.memory_on(80 * 1024), 1000);
}

fn arb_quantity() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..1000).prop_map(|n| n.to_string()),
        "[0-9]{0,3}\\.?[0-9]{0,3}(m|Ki|Gi|k|e3|E)?",
        ".{0,8}",
    ]
}

fn arb_resource() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("tessera.io/gpu-core".to_string()),
        Just("tessera.io/gpu-memory".to_string()),
        Just("tessera.io/mig-1g.10gb".to_string()),
        "tessera.io/mig-[a-z0-9.+]{0,10}",
        "tessera.io/[a-z-]{0,8}",
        Just("cpu".to_string()),
        Just("memory".to_string()),
    ]
}

proptest! {
    #[test]
    fn parser_never_panics(
        limits in proptest::collection::vec((arb_resource(), arb_quantity()), 0..5),
        requests in proptest::collection::vec((arb_resource(), arb_quantity()), 0..5),
        annotation in ".{0,12}",
    ) {
        let mut c = Container { name: "c".into(), ..Default::default() };
        c.resources = Some(ResourceRequirements {
            limits: Some(limits.into_iter().map(|(k, v)| (k, Quantity(v))).collect()),
            requests: Some(requests.into_iter().map(|(k, v)| (k, Quantity(v))).collect()),
            ..Default::default()
        });
        let p = pod(vec![c], &[("tessera.io/core-limit", &annotation), ("tessera.io/gpu-model", &annotation)]);
        if let Ok(r) = PodRequest::from_pod(&p, &RequestOptions::default()) {
            // Whatever parses is well-formed.
            match &r.containers[0].gpu {
                GpuDemand::Share(s) => prop_assert!(s.core_percent <= 100 && (s.core_percent > 0 || s.memory_mib.is_some())),
                GpuDemand::Whole { cards, .. } => prop_assert!(*cards >= 1),
                GpuDemand::Mig(m) => prop_assert!(m.iter().all(|d| d.count >= 1)),
                GpuDemand::None => {}
            }
        }
    }
}

#[test]
fn a_hundred_percent_without_memory_is_one_whole_gpu() {
    let r = parse(vec![container("a", &[("tessera.io/gpu-core", "100")])]).unwrap();
    assert_eq!(
        r.containers[0].gpu,
        GpuDemand::Whole {
            cards: 1,
            min_memory_mib: None
        }
    );
    let r = parse(vec![container(
        "a",
        &[("tessera.io/gpu-core", "100"), ("tessera.io/gpu-memory", "8")],
    )])
    .unwrap();
    assert_eq!(
        r.containers[0].gpu,
        GpuDemand::Share(GpuShare {
            core_percent: 100,
            memory_mib: Some(8192)
        })
    );
}

/// Counts no node could ever serve are refused as they are parsed, quickly: a MIG count of four
/// billion once made a claim's bookkeeping build a list that long under the ledger's lock.
#[test]
fn device_counts_past_any_node_are_refused_at_parsing() {
    let t = std::time::Instant::now();
    let e = gpu_of(&[("tessera.io/mig-1g.10gb", "4000000000")]).unwrap_err();
    assert!(matches!(e, RequestError::TooLarge { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("tessera.io/mig-1g.10gb=\"4000000000\" is too large"),
        "{e}"
    );
    assert!(gpu_of(&[("tessera.io/mig-1g.10gb", "129")]).is_err());
    assert!(gpu_of(&[("tessera.io/mig-1g.10gb", "128")]).is_ok());
    let e = gpu_of(&[("tessera.io/gpu-core", "400000000")]).unwrap_err();
    assert!(matches!(e, RequestError::CoreOutOfRange { .. }), "{e}");
    assert!(gpu_of(&[("tessera.io/gpu-core", "12800")]).is_ok());
    assert!(t.elapsed() < std::time::Duration::from_millis(100), "{:?}", t.elapsed());
}
