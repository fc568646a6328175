//! The extender: its Deployment, the Services of its verbs and webhook, who may reach it, and
//! its disruption budget.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, HTTPGetAction, PodSpec, PodTemplateSpec, Probe, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::build::{Objects, env_field, keys_volume, meta, mount, resources, restricted, selector};
use crate::{
    EXTENDER, EXTENDER_PORT, EXTENDER_TLS_SECRET, KEYS_SECRET, ManifestOptions, SCHEDULER, SCHEDULER_TLS_SECRET, claims,
};

fn http_probe(path: &str, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(EXTENDER_PORT),
            // The verbs' port is HTTPS; probes need no client certificate.
            scheme: Some("HTTPS".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        ..Default::default()
    }
}

/// Who may reach the extender's pods: its verbs (filter, prioritize, bind) only from the
/// `tessera` scheduler's pods; its admission webhook from anywhere (the API server calls it
/// from outside the pod network). Held where the cluster's network plugin enforces
/// NetworkPolicy; the verbs also require the scheduler's client certificate.
pub fn extender_network_policy(opts: &ManifestOptions) -> NetworkPolicy {
    let tcp = |port: i32| NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".into()),
        ..Default::default()
    };
    NetworkPolicy {
        metadata: meta(EXTENDER, Some(&opts.namespace)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector(EXTENDER)),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(LabelSelector {
                            match_labels: Some(selector(SCHEDULER)),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ports: Some(vec![tcp(EXTENDER_PORT)]),
                },
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![tcp(claims::WEBHOOK_PORT)]),
                },
            ]),
            ..Default::default()
        }),
    }
}

/// The extender's Deployment, Services, NetworkPolicy and PodDisruptionBudget.
pub(crate) fn objects(opts: &ManifestOptions, out: &mut Objects) {
    let ns = opts.namespace.as_str();
    out.push(&Deployment {
        metadata: meta(EXTENDER, Some(ns)),
        spec: Some(DeploymentSpec {
            replicas: Some(opts.replicas),
            selector: LabelSelector {
                match_labels: Some(selector(EXTENDER)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(meta(EXTENDER, None)),
                spec: Some(PodSpec {
                    service_account_name: Some(EXTENDER.into()),
                    priority_class_name: Some("system-cluster-critical".into()),
                    containers: vec![Container {
                        name: "extender".into(),
                        image: Some(opts.image.clone()),
                        command: Some(vec!["tessera-extender".into()]),
                        args: Some(vec![
                            "serve".into(),
                            format!("--listen=0.0.0.0:{EXTENDER_PORT}"),
                            "--keys-dir=/etc/tessera/keys".into(),
                            format!("--tls-secret={EXTENDER_TLS_SECRET}"),
                            format!("--scheduler-tls-secret={SCHEDULER_TLS_SECRET}"),
                            format!("--tls-service={EXTENDER}"),
                            format!("--webhook-listen=0.0.0.0:{}", claims::WEBHOOK_PORT),
                            format!("--webhook-secret={}", claims::WEBHOOK_SECRET),
                            format!("--webhook-service={}", claims::WEBHOOK_SERVICE),
                            format!("--webhook-configuration={}", claims::WEBHOOK_CONFIGURATION),
                        ]),
                        env: Some(vec![
                            env_field("POD_NAME", "metadata.name"),
                            env_field("POD_NAMESPACE", "metadata.namespace"),
                            EnvVar {
                                name: "RUST_LOG".into(),
                                value: Some("info".into()),
                                ..Default::default()
                            },
                        ]),
                        ports: Some(vec![
                            ContainerPort {
                                name: Some("http".into()),
                                container_port: EXTENDER_PORT,
                                ..Default::default()
                            },
                            ContainerPort {
                                name: Some("webhook".into()),
                                container_port: claims::WEBHOOK_PORT,
                                ..Default::default()
                            },
                        ]),
                        // Ready once synced, leader or not (so rollouts complete); the Service
                        // selects the leader by its role label, and /readyz answers for it.
                        readiness_probe: Some(http_probe("/syncedz", 2)),
                        liveness_probe: Some(http_probe("/healthz", 10)),
                        resources: Some(resources("200m", "256Mi", "2Gi")),
                        security_context: Some(restricted()),
                        volume_mounts: Some(vec![mount("handoff-keys", "/etc/tessera/keys", true)]),
                        ..Default::default()
                    }],
                    volumes: Some(vec![keys_volume(KEYS_SECRET)]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    });
    let mut leader = selector(EXTENDER);
    leader.insert(
        tessera_core::names::LABEL_EXTENDER_ROLE.to_string(),
        "leader".to_string(),
    );
    out.push(&Service {
        metadata: meta(EXTENDER, Some(ns)),
        spec: Some(ServiceSpec {
            selector: Some(leader),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: EXTENDER_PORT,
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    });
    out.push(&claims::webhook_service(opts));
    out.push(&extender_network_policy(opts));
    out.push(&PodDisruptionBudget {
        metadata: meta(EXTENDER, Some(ns)),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector(EXTENDER)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
}
