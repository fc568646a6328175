//! What the extender reads of a pod from its watch, and nothing else.
//!
//! A cluster's pods are read in full by the pod watch, most of them pods Tessera never
//! places. Deserialising each one as a [`Pod`] allocates its whole spec (images, env,
//! volumes, probes, statuses) only to drop it; [`PodView`] reads the fields placement
//! decisions use and skips the rest of the JSON without allocating. It converts into a
//! [`Pod`] holding just those fields, which is what the rest of the extender takes.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Pod, PodSecurityContext, PodSpec, PodStatus, ResourceRequirements, SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::NamespaceResourceScope;
use serde::Deserialize;

/// A pod as the extender's watch reads it: name, namespace, UID, resource version and
/// annotations; node, containers' names, resources, restart policies and users, overhead;
/// phase.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodView {
    #[serde(default, deserialize_with = "meta")]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<SpecView>,
    #[serde(default)]
    status: Option<StatusView>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaView {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    annotations: Option<BTreeMap<String, String>>,
}

fn meta<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = MetaView::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        annotations: m.annotations,
        ..Default::default()
    })
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecView {
    node_name: Option<String>,
    // Bind checks both: only Tessera's pods, only where they may run.
    scheduler_name: Option<String>,
    tolerations: Option<Vec<Toleration>>,
    #[serde(default)]
    containers: Vec<ContainerView>,
    init_containers: Option<Vec<ContainerView>>,
    overhead: Option<BTreeMap<String, Quantity>>,
    #[serde(default, deserialize_with = "pod_user")]
    security_context: Option<PodSecurityContext>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerView {
    #[serde(default)]
    name: String,
    resources: Option<ResourceRequirements>,
    restart_policy: Option<String>,
    #[serde(default, deserialize_with = "container_user")]
    security_context: Option<SecurityContext>,
}

/// Only `runAsUser` of a security context is read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct UserView {
    run_as_user: Option<i64>,
}

fn pod_user<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<PodSecurityContext>, D::Error> {
    Ok(Option::<UserView>::deserialize(d)?.map(|u| PodSecurityContext {
        run_as_user: u.run_as_user,
        ..Default::default()
    }))
}

fn container_user<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<SecurityContext>, D::Error> {
    Ok(Option::<UserView>::deserialize(d)?.map(|u| SecurityContext {
        run_as_user: u.run_as_user,
        ..Default::default()
    }))
}

#[derive(Clone, Debug, Default, Deserialize)]
struct StatusView {
    phase: Option<String>,
}

impl From<ContainerView> for Container {
    fn from(c: ContainerView) -> Self {
        Container {
            name: c.name,
            resources: c.resources,
            restart_policy: c.restart_policy,
            security_context: c.security_context,
            ..Default::default()
        }
    }
}

impl From<PodView> for Pod {
    fn from(p: PodView) -> Self {
        Pod {
            metadata: p.metadata,
            spec: p.spec.map(|s| PodSpec {
                node_name: s.node_name,
                scheduler_name: s.scheduler_name,
                tolerations: s.tolerations,
                containers: s.containers.into_iter().map(Container::from).collect(),
                init_containers: s.init_containers.map(|v| v.into_iter().map(Container::from).collect()),
                overhead: s.overhead,
                security_context: s.security_context,
                ..Default::default()
            }),
            status: p.status.map(|s| PodStatus {
                phase: s.phase,
                ..Default::default()
            }),
        }
    }
}

impl kube::Resource for PodView {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("Pod")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("v1")
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("pods")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::request::{PodRequest, RequestOptions, is_tessera_pod};

    /// A pod using every field the extender reads, among many it does not.
    fn full_pod() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "train", "namespace": "ml", "uid": "u-1", "resourceVersion": "42",
                "labels": {"app": "train"},
                "annotations": {"tessera.io/core-limit": "60", "note": "x"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "ReplicaSet", "name": "rs", "uid": "o"}],
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
            },
            "spec": {
                "nodeName": "gpu-1",
                "securityContext": {"runAsUser": 1000, "fsGroup": 2000},
                "overhead": {"cpu": "250m", "memory": "64Mi"},
                "volumes": [{"name": "data", "emptyDir": {}}],
                "initContainers": [
                    {"name": "fetch", "image": "busybox", "command": ["sh", "-c", "true"],
                     "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}},
                    {"name": "sidecar", "image": "envoy", "restartPolicy": "Always",
                     "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}
                ],
                "containers": [
                    {"name": "main", "image": "pytorch:2", "env": [{"name": "A", "value": "b"}],
                     "securityContext": {"runAsUser": 1001, "privileged": false},
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                     "livenessProbe": {"exec": {"command": ["true"]}},
                     "resources": {
                        "requests": {"cpu": "4", "memory": "16Gi", "tessera.io/gpu-core": "30",
                                     "tessera.io/gpu-memory": "8Gi"},
                        "limits": {"tessera.io/gpu-core": "30", "tessera.io/gpu-memory": "8Gi"}}}
                ]
            },
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}]}
        })
    }

    #[test]
    fn the_view_asks_for_what_the_full_pod_asks_for() {
        let full: Pod = serde_json::from_value(full_pod()).unwrap();
        let view: Pod = serde_json::from_value::<PodView>(full_pod()).unwrap().into();
        let opts = RequestOptions::default();
        let (a, b) = (
            PodRequest::from_pod(&full, &opts).unwrap(),
            PodRequest::from_pod(&view, &opts).unwrap(),
        );
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert!(a.wants_gpu() && is_tessera_pod(&view));
        assert_eq!(
            a.containers.iter().filter_map(|c| c.run_as_user).collect::<Vec<_>>(),
            [1000, 1000, 1001]
        );

        let m = &view.metadata;
        assert_eq!(
            (
                m.name.as_deref(),
                m.namespace.as_deref(),
                m.uid.as_deref(),
                m.resource_version.as_deref()
            ),
            (Some("train"), Some("ml"), Some("u-1"), Some("42"))
        );
        assert_eq!(m.annotations, full.metadata.annotations);
        assert!(m.labels.is_none() && m.managed_fields.is_none() && m.owner_references.is_none());
        let spec = view.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("gpu-1"));
        assert!(spec.volumes.is_none() && spec.containers[0].image.is_none() && spec.containers[0].env.is_none());
        assert_eq!(view.status.unwrap().phase.as_deref(), Some("Running"));
    }

    #[test]
    fn a_pod_without_spec_or_status_still_reads() {
        let p: Pod = serde_json::from_value::<PodView>(serde_json::json!({"metadata": {"name": "p"}}))
            .unwrap()
            .into();
        assert_eq!(p.metadata.name.as_deref(), Some("p"));
        assert!(p.spec.is_none() && p.status.is_none());
    }
}
