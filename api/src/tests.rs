use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::request::RequestOptions;

use crate::claim::{ClaimError, ElasticGpuClaim};
use crate::class::{BindingMode, ElasticGpuClass, ReclaimPolicy};
use crate::egpu::GpuDevice;
use crate::pod::{PodClaimError, claim_refs};

/// elastic-gpu's README example, with only the group/version changed.
const SEED: &str = r#"
apiVersion: tessera.io/v1alpha1
kind: ElasticGPUClass
metadata:
  name: gpushare-egpuclass
provisioner: gpushare.provisioner.elasticgpu.io
reclaimPolicy: Retain
egpuBindingMode: Immediate
---
apiVersion: tessera.io/v1alpha1
kind: ElasticGPUClaim
metadata:
  name: gpushare-egpuc-1
  namespace: default
spec:
  egpuClassName: gpushare-egpuclass
  resources:
    requests:
      gpushare.provisioner.elasticgpu.io/gpu-core: 10
      gpushare.provisioner.elasticgpu.io/gpu-memory: 4
"#;

fn docs() -> Vec<Value> {
    serde_yaml::Deserializer::from_str(SEED)
        .map(|d| serde_json::to_value(serde_yaml::Value::deserialize(d).unwrap()).unwrap())
        .collect()
}

use serde::Deserialize as _;

fn claim(spec: Value) -> ElasticGpuClaim {
    serde_json::from_value(json!({
        "apiVersion": "tessera.io/v1alpha1", "kind": "ElasticGPUClaim",
        "metadata": {"name": "c", "namespace": "ml"}, "spec": spec
    }))
    .unwrap()
}

fn resources(c: &ElasticGpuClaim) -> Result<BTreeMap<String, String>, ClaimError> {
    c.container_resources(&RequestOptions::default())
        .map(|m| m.into_iter().map(|(k, Quantity(v))| (k, v)).collect())
}

fn map(v: &[(&str, &str)]) -> BTreeMap<String, String> {
    v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn elastic_gpus_example_reads_with_only_its_group_changed() {
    let d = docs();
    let class: ElasticGpuClass = serde_json::from_value(d[0].clone()).unwrap();
    assert_eq!(class.spec.provisioner, "gpushare.provisioner.elasticgpu.io");
    assert_eq!(class.spec.reclaim_policy, ReclaimPolicy::Retain);
    assert_eq!(class.spec.egpu_binding_mode, BindingMode::Immediate);
    // Its fields stay on the top level when written back.
    let back = serde_json::to_value(&class).unwrap();
    assert_eq!(back["reclaimPolicy"], "Retain");
    assert!(back.get("spec").is_none());

    let c: ElasticGpuClaim = serde_json::from_value(d[1].clone()).unwrap();
    assert_eq!(c.class_name().unwrap(), "gpushare-egpuclass");
    assert_eq!(
        resources(&c).unwrap(),
        map(&[("tessera.io/gpu-core", "10"), ("tessera.io/gpu-memory", "4")])
    );
}

#[test]
fn claims_read_tessera_and_elastic_gpu_resource_names() {
    let whole = claim(json!({"elasticGPUClassName": "x", "resources": {"limits": {"nvidia.com/gpu": 2}}}));
    assert_eq!(whole.class_name().unwrap(), "x");
    assert_eq!(resources(&whole).unwrap(), map(&[("tessera.io/gpu-core", "200")]));
    let qgpu = claim(json!({"egpuClassName": "x", "resources": {"requests": {
        "elasticgpu.com/qgpu-core": "25", "elasticgpu.com/qgpu-memory": "8"}}}));
    assert_eq!(
        resources(&qgpu).unwrap(),
        map(&[("tessera.io/gpu-core", "25"), ("tessera.io/gpu-memory", "8")])
    );
    let mig = claim(json!({"egpuClassName": "x", "resources": {"limits": {"tessera.io/mig-1g.10gb": 1}}}));
    assert_eq!(resources(&mig).unwrap(), map(&[("tessera.io/mig-1g.10gb", "1")]));
}

#[test]
fn bad_claims_say_which_field_and_value() {
    let err = |spec: Value| resources(&claim(spec)).unwrap_err().to_string();
    assert_eq!(
        err(json!({"egpuClassName": "x", "resources": {"requests": {"cpu": "2"}}})),
        "ElasticGPUClaim ml/c: spec.resources.requests[\"cpu\"]=\"2\": not a GPU resource (use tessera.io/gpu-core, tessera.io/gpu-memory or tessera.io/mig-<profile>)"
    );
    assert!(
        err(json!({"egpuClassName": "x", "resources": {"requests": {"example.com/gpu-core": "2"}}}))
            .contains("spec.resources.requests[\"example.com/gpu-core\"]=\"2\": not a GPU resource Tessera knows")
    );
    assert!(
        err(json!({"egpuClassName": "x", "resources": {"requests": {"tessera.io/gpu-core": "150"}}}))
            .contains("tessera.io/gpu-core=150 is invalid")
    );
    assert!(
        err(
            json!({"egpuClassName": "x", "resources": {"requests": {"tessera.io/gpu-core": "30"},
            "limits": {"tessera.io/gpu-core": "40"}}})
        )
        .contains("differs from limit")
    );
    assert!(
        err(json!({"egpuClassName": "x", "resources": {"requests": {
            "nvidia.com/gpu": "1", "elasticgpu.io/gpu-core": "50"}}}))
        .contains("stands for tessera.io/gpu-core, which another of its resources sets to")
    );
    assert_eq!(
        err(json!({"egpuClassName": "x", "resources": {}})),
        "ElasticGPUClaim ml/c: spec.resources asks for no GPU"
    );
    let c = claim(json!({"egpuClassName": "a", "elasticGPUClassName": "b", "resources": {}}));
    assert!(
        c.class_name()
            .unwrap_err()
            .to_string()
            .contains("name different classes")
    );
    let c = claim(json!({"resources": {}}));
    assert_eq!(
        c.class_name().unwrap_err().to_string(),
        "ElasticGPUClaim ml/c: spec.egpuClassName is required"
    );
}

fn pod(annotations: &[(&str, &str)], containers: &[&str]) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ml",
            "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()},
        "spec": {"containers": containers.iter().map(|c| json!({"name": c})).collect::<Vec<_>>()}
    }))
    .unwrap()
}

#[test]
fn pods_name_claims_in_either_form() {
    let p = pod(
        &[
            ("egpuc.elasticgpu.io/a", "claim-a"),
            ("claim.tessera.io/b", "claim-b"),
            ("claim.tessera.io/a", "claim-a"),
            ("other.io/x", "y"),
        ],
        &["a", "b", "c"],
    );
    let uses: Vec<(String, String)> = claim_refs(&p)
        .unwrap()
        .into_iter()
        .map(|u| (u.container, u.claim))
        .collect();
    assert_eq!(uses, [("a".into(), "claim-a".into()), ("b".into(), "claim-b".into())]);
    assert!(claim_refs(&pod(&[], &["a"])).unwrap().is_empty());

    let e = claim_refs(&pod(&[("egpuc.elasticgpu.io/test1", "c1")], &["test-cuda"])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "annotation egpuc.elasticgpu.io/test1=\"c1\" names container \"test1\", which the pod does not have (its containers: test-cuda)"
    );
    assert!(matches!(
        claim_refs(&pod(
            &[("egpuc.elasticgpu.io/a", "c1"), ("claim.tessera.io/a", "c2")],
            &["a"]
        )),
        Err(PodClaimError::TwoClaims { .. })
    ));
    assert!(matches!(
        claim_refs(&pod(
            &[("egpuc.elasticgpu.io/a", "c1"), ("egpuc.elasticgpu.io/b", "c1")],
            &["a", "b"]
        )),
        Err(PodClaimError::SharedClaim { .. })
    ));
    assert!(matches!(
        claim_refs(&pod(&[("egpuc.elasticgpu.io/a", "Bad_Name")], &["a"])),
        Err(PodClaimError::BadName { .. })
    ));
}

#[test]
fn devices_round_trip_through_the_elastic_gpu_record() {
    let devices = [
        AllocatedDevice::Gpu {
            uuid: "GPU-a".into(),
            index: 3,
            minor: 5,
            core_percent: 10,
            memory_mib: 4096,
            exclusive: false,
        },
        AllocatedDevice::Mig {
            uuid: "MIG-b".into(),
            profile: "1g.10gb".parse().unwrap(),
            parent_uuid: "GPU-c".into(),
            parent_index: 1,
            gi: 7,
            ci: 0,
        },
    ];
    for d in devices {
        let rec = GpuDevice::from(&d);
        let json = serde_json::to_value(&rec).unwrap();
        let back: GpuDevice = serde_json::from_value(json).unwrap();
        assert_eq!(AllocatedDevice::try_from(&back).unwrap(), d);
    }
    let no_minor = GpuDevice {
        uuid: "GPU-x".into(),
        ..Default::default()
    };
    assert!(
        AllocatedDevice::try_from(&no_minor)
            .unwrap_err()
            .to_string()
            .contains("needs its minor")
    );
}

/// Walks a schema: every node has a type (or says it is int-or-string / preserves unknown
/// fields), and nothing refers elsewhere: the API server accepts only structural schemas.
fn assert_structural(path: &str, s: &Value) {
    let o = s.as_object().unwrap_or_else(|| panic!("{path}: not an object"));
    for bad in ["$ref", "oneOf", "anyOf", "allOf", "definitions", "$defs"] {
        assert!(!o.contains_key(bad), "{path} has {bad}: {s}");
    }
    assert!(
        o.contains_key("type") || o.contains_key("x-kubernetes-int-or-string"),
        "{path} has no type: {s}"
    );
    // Formats the API server knows (it warns about any other on every apply).
    if let Some(f) = o.get("format").and_then(Value::as_str) {
        assert!(
            [
                "int32",
                "int64",
                "float",
                "double",
                "byte",
                "date",
                "date-time",
                "password"
            ]
            .contains(&f),
            "{path} has format {f:?}"
        );
    }
    for (k, v) in o.get("properties").and_then(Value::as_object).into_iter().flatten() {
        assert_structural(&format!("{path}.{k}"), v);
    }
    for key in ["items", "additionalProperties"] {
        if let Some(v) = o.get(key).filter(|v| v.is_object()) {
            assert_structural(&format!("{path}.{key}"), v);
        }
    }
}

#[test]
fn the_crds_are_structural_with_status_and_printer_columns() {
    let crds = crate::crds();
    let by_kind: BTreeMap<&str, Value> = crds
        .iter()
        .map(|c| (c.spec.names.kind.as_str(), serde_json::to_value(c).unwrap()))
        .collect();
    assert_eq!(
        by_kind.keys().copied().collect::<Vec<_>>(),
        ["ElasticGPU", "ElasticGPUClaim", "ElasticGPUClass"]
    );
    for (kind, crd) in &by_kind {
        let version = &crd["spec"]["versions"][0];
        assert_eq!(crd["spec"]["group"], "tessera.io");
        assert_eq!(version["name"], "v1alpha1");
        assert_structural(kind, &version["schema"]["openAPIV3Schema"]);
        assert!(
            version["additionalPrinterColumns"].as_array().unwrap().len() >= 4,
            "{kind}"
        );
        let has_status = version["subresources"]["status"].is_object();
        assert_eq!(has_status, *kind != "ElasticGPUClass", "{kind}");
    }
    let scope = |k: &str| by_kind[k]["spec"]["scope"].as_str().unwrap().to_string();
    assert_eq!(
        (scope("ElasticGPU"), scope("ElasticGPUClaim"), scope("ElasticGPUClass")),
        ("Cluster".into(), "Namespaced".into(), "Cluster".into())
    );
    let short = |k: &str| {
        by_kind[k]["spec"]["names"]["shortNames"][0]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        (short("ElasticGPU"), short("ElasticGPUClaim"), short("ElasticGPUClass")),
        ("egpu".into(), "egpuc".into(), "egpuclass".into())
    );
    let class = &by_kind["ElasticGPUClass"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    assert_eq!(
        class["properties"]["reclaimPolicy"]["enum"],
        json!(["Delete", "Retain"])
    );
    assert!(class["required"].as_array().unwrap().contains(&json!("provisioner")));
    let claim = &by_kind["ElasticGPUClaim"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let requests = &claim["properties"]["spec"]["properties"]["resources"]["properties"]["requests"];
    assert_eq!(requests["additionalProperties"]["x-kubernetes-int-or-string"], true);
}
