//! Builders the objects share: metadata, selectors, RBAC rules and bindings, env, resources,
//! volumes, security contexts.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EnvVar, EnvVarSource, HostPathVolumeSource, ObjectFieldSelector, ResourceRequirements, SecretVolumeSource,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, PolicyRule, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;

/// Objects in apply order, each as JSON (so that differently typed objects go in one list).
#[derive(Default)]
pub(crate) struct Objects(pub(crate) Vec<serde_json::Value>);

impl Objects {
    pub(crate) fn push(&mut self, object: &impl Serialize) {
        self.0.push(serde_json::to_value(object).expect("manifests serialize"));
    }
}

pub(crate) fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        labels: Some(BTreeMap::from([
            ("app.kubernetes.io/name".to_string(), name.to_string()),
            ("app.kubernetes.io/part-of".to_string(), "tessera".to_string()),
        ])),
        ..Default::default()
    }
}

pub(crate) fn selector(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("app.kubernetes.io/name".to_string(), name.to_string())])
}

pub(crate) fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(v(groups)),
        resources: Some(v(resources)),
        verbs: v(verbs),
        ..Default::default()
    }
}

pub(crate) fn sa_subject(name: &str, ns: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".into(),
        name: name.into(),
        namespace: Some(ns.into()),
        ..Default::default()
    }]
}

pub(crate) fn cluster_binding(name: &str, role: &str, sa: &str, ns: &str) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: meta(name, None),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(sa_subject(sa, ns)),
    }
}

pub(crate) fn role_binding(name: &str, ns: &str, kind: &str, role: &str, sa: &str, sa_ns: &str) -> RoleBinding {
    RoleBinding {
        metadata: meta(name, Some(ns)),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: kind.into(),
            name: role.into(),
        },
        subjects: Some(sa_subject(sa, sa_ns)),
    }
}

pub(crate) fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(crate) fn resources(cpu: &str, memory: &str, memory_limit: &str) -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(cpu.into())),
            ("memory".to_string(), Quantity(memory.into())),
        ])),
        limits: Some(BTreeMap::from([("memory".to_string(), Quantity(memory_limit.into()))])),
        ..Default::default()
    }
}

pub(crate) fn host_path(name: &str, path: &str, kind: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.into(),
            type_: Some(kind.into()),
        }),
        ..Default::default()
    }
}

pub(crate) fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

pub(crate) fn keys_volume(secret: &str) -> Volume {
    Volume {
        name: "handoff-keys".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(crate) fn restricted() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        capabilities: Some(k8s_openapi::api::core::v1::Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}
