//! The `tessera` scheduler: kube-scheduler with the extender configured, its configuration
//! rendered here.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, HTTPGetAction, PodSpec, PodTemplateSpec, Probe, SecretVolumeSource,
    SecurityContext, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tessera_core::names::{RESOURCE_GPU_CORE, RESOURCE_GPU_MEMORY, RESOURCE_MIG_PREFIX};

use crate::build::{Objects, meta, mount, resources, restricted, selector};
use crate::{EXTENDER, EXTENDER_PORT, ManifestOptions, SCHEDULER, SCHEDULER_NAME, SCHEDULER_TLS_SECRET};

/// Where the scheduler mounts its client certificate.
const SCHEDULER_CLIENT_DIR: &str = "/etc/tessera/extender-client";

/// MIG profiles listed as scheduler-managed resources (A100 and H100 families).
const MIG_PROFILES: &[&str] = &[
    "1g.5gb", "1g.10gb", "1g.12gb", "1g.20gb", "2g.10gb", "2g.20gb", "2g.24gb", "3g.20gb", "3g.40gb", "3g.47gb",
    "4g.20gb", "4g.40gb", "4g.47gb", "7g.40gb", "7g.80gb", "7g.94gb",
];

/// The KubeSchedulerConfiguration of the `tessera` scheduler profile. It looks at every node
/// for a pod by default ([`ManifestOptions::percentage_of_nodes_to_score`]): kube-scheduler
/// otherwise asks the extender about a sample of the nodes its own checks pass, which add a
/// node's GPU resources up, and a pod whose only fitting card lies beyond the sample waits.
pub fn scheduler_config(opts: &ManifestOptions) -> String {
    let mut managed = vec![RESOURCE_GPU_CORE.to_string(), RESOURCE_GPU_MEMORY.to_string()];
    managed.extend(MIG_PROFILES.iter().map(|p| format!("{RESOURCE_MIG_PREFIX}{p}")));
    let managed: String = managed
        .iter()
        .map(|m| format!("  - name: {m}\n    ignoredByScheduler: false\n"))
        .collect();
    format!(
        "apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
  resourceName: {SCHEDULER}
  resourceNamespace: {ns}
profiles:
- schedulerName: {SCHEDULER_NAME}
  percentageOfNodesToScore: {percentage}
extenders:
- urlPrefix: https://{EXTENDER}.{ns}.svc:{EXTENDER_PORT}/tessera
  tlsConfig:
    serverName: {EXTENDER}.{ns}.svc
    caFile: {SCHEDULER_CLIENT_DIR}/ca.crt
    certFile: {SCHEDULER_CLIENT_DIR}/tls.crt
    keyFile: {SCHEDULER_CLIENT_DIR}/tls.key
  filterVerb: filter
  prioritizeVerb: prioritize
  weight: 5
  bindVerb: bind
  preemptVerb: preempt
  nodeCacheCapable: true
  httpTimeout: 5s
  ignorable: false
  managedResources:
{managed}",
        ns = opts.namespace,
        percentage = opts.percentage_of_nodes_to_score,
    )
}

/// The scheduler's configuration and its Deployment.
pub(crate) fn objects(opts: &ManifestOptions, out: &mut Objects) {
    let ns = opts.namespace.as_str();
    out.push(&ConfigMap {
        metadata: meta(SCHEDULER, Some(ns)),
        data: Some(BTreeMap::from([(
            "scheduler-config.yaml".to_string(),
            scheduler_config(opts),
        )])),
        ..Default::default()
    });
    out.push(&Deployment {
        metadata: meta(SCHEDULER, Some(ns)),
        spec: Some(DeploymentSpec {
            replicas: Some(2),
            selector: LabelSelector {
                match_labels: Some(selector(SCHEDULER)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(meta(SCHEDULER, None)),
                spec: Some(PodSpec {
                    service_account_name: Some(SCHEDULER.into()),
                    priority_class_name: Some("system-cluster-critical".into()),
                    containers: vec![Container {
                        name: "kube-scheduler".into(),
                        image: Some(opts.scheduler_image.clone()),
                        command: Some(vec![
                            "kube-scheduler".into(),
                            "--config=/etc/tessera/scheduler-config.yaml".into(),
                        ]),
                        liveness_probe: Some(Probe {
                            http_get: Some(HTTPGetAction {
                                path: Some("/healthz".into()),
                                port: IntOrString::Int(10259),
                                scheme: Some("HTTPS".into()),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }),
                        resources: Some(resources("100m", "128Mi", "512Mi")),
                        // kube-scheduler may write its self-signed serving certificate.
                        security_context: Some(SecurityContext {
                            read_only_root_filesystem: Some(false),
                            ..restricted()
                        }),
                        volume_mounts: Some(vec![
                            mount("config", "/etc/tessera", true),
                            mount("extender-client", SCHEDULER_CLIENT_DIR, true),
                        ]),
                        ..Default::default()
                    }],
                    volumes: Some(vec![
                        Volume {
                            name: "config".into(),
                            config_map: Some(ConfigMapVolumeSource {
                                name: SCHEDULER.into(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                        // Its own Secret, which the extender writes (the pod waits for it):
                        // the CA and its client certificate.
                        Volume {
                            name: "extender-client".into(),
                            secret: Some(SecretVolumeSource {
                                secret_name: Some(SCHEDULER_TLS_SECRET.into()),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                    ]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    });
}
