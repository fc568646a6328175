//! The install objects of ElasticGPU claims: the three CRDs, the extender's rights on them, the
//! webhook's Service and its MutatingWebhookConfiguration (the CA is written in by the
//! extender, see `admission::certs`).

use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference,
    WebhookClientConfig,
};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tessera_api::pod::{ELASTIC_GPU_CLAIM_PREFIX, TESSERA_CLAIM_PREFIX};

use crate::build::{meta, rule, selector};
use crate::{EXTENDER, ManifestOptions};
use tessera_api::pod::MUTATE_PODS_PATH;

/// The webhook's Service (every replica serves it, leader or not).
pub const WEBHOOK_SERVICE: &str = "tessera-extender-webhook";
/// The port the extender serves the webhook on.
pub const WEBHOOK_PORT: i32 = 9443;
/// The Secret the extender keeps the webhook's certificate in.
pub const WEBHOOK_SECRET: &str = "tessera-webhook-tls";
/// The MutatingWebhookConfiguration's name.
pub const WEBHOOK_CONFIGURATION: &str = EXTENDER;

/// The extender's rights on the custom resources and its webhook configuration.
pub fn extender_rules() -> Vec<PolicyRule> {
    vec![
        rule(
            &["tessera.io"],
            &["elasticgpus"],
            &["get", "list", "watch", "create", "delete"],
        ),
        rule(
            &["tessera.io"],
            &["elasticgpus/status", "elasticgpuclaims/status"],
            &["patch", "update"],
        ),
        rule(
            &["tessera.io"],
            &["elasticgpuclaims", "elasticgpuclasses"],
            &["get", "list", "watch"],
        ),
        PolicyRule {
            resource_names: Some(vec![WEBHOOK_CONFIGURATION.into()]),
            ..rule(
                &["admissionregistration.k8s.io"],
                &["mutatingwebhookconfigurations"],
                &["get", "list", "watch", "update"],
            )
        },
    ]
}

/// The extender's rights in its namespace: its certificates' Secrets, read and followed by
/// name (list and watch by name need a `metadata.name` field selector, which it sends); its
/// verbs' Secret marked and replaced; the scheduler's Secret replaced, never read.
pub fn extender_namespace_rules() -> Vec<PolicyRule> {
    vec![
        PolicyRule {
            resource_names: Some(vec![WEBHOOK_SECRET.into(), super::EXTENDER_TLS_SECRET.into()]),
            ..rule(&[""], &["secrets"], &["get", "list", "watch"])
        },
        PolicyRule {
            resource_names: Some(vec![super::EXTENDER_TLS_SECRET.into()]),
            ..rule(&[""], &["secrets"], &["patch", "delete"])
        },
        PolicyRule {
            resource_names: Some(vec![super::SCHEDULER_TLS_SECRET.into()]),
            ..rule(&[""], &["secrets"], &["update"])
        },
        // Create cannot be limited by name (the object does not exist yet).
        rule(&[""], &["secrets"], &["create"]),
    ]
}

/// The webhook's Service.
pub fn webhook_service(opts: &ManifestOptions) -> Service {
    Service {
        metadata: meta(WEBHOOK_SERVICE, Some(&opts.namespace)),
        spec: Some(ServiceSpec {
            selector: Some(selector(EXTENDER)),
            ports: Some(vec![ServicePort {
                name: Some("webhook".into()),
                port: 443,
                target_port: Some(IntOrString::String("webhook".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The webhook configuration: pod CREATE, only pods whose annotations name a claim (so that
/// an unavailable extender never blocks other pods), never in kube-system or Tessera's own
/// namespace; a pod naming a claim is refused rather than admitted without its GPU.
pub fn webhook_configuration(opts: &ManifestOptions) -> MutatingWebhookConfiguration {
    let condition = format!(
        "has(object.metadata.annotations) && object.metadata.annotations.exists(k, k.startsWith('{ELASTIC_GPU_CLAIM_PREFIX}') || k.startsWith('{TESSERA_CLAIM_PREFIX}'))"
    );
    MutatingWebhookConfiguration {
        metadata: meta(WEBHOOK_CONFIGURATION, None),
        webhooks: Some(vec![MutatingWebhook {
            name: "pods.claims.tessera.io".into(),
            admission_review_versions: vec!["v1".into()],
            client_config: WebhookClientConfig {
                service: Some(ServiceReference {
                    namespace: opts.namespace.clone(),
                    name: WEBHOOK_SERVICE.into(),
                    path: Some(MUTATE_PODS_PATH.into()),
                    port: Some(443),
                }),
                ..Default::default()
            },
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec![String::new()]),
                api_versions: Some(vec!["v1".into()]),
                operations: Some(vec!["CREATE".into()]),
                resources: Some(vec!["pods".into()]),
                scope: Some("Namespaced".into()),
            }]),
            match_conditions: Some(vec![MatchCondition {
                name: "names-an-elastic-gpu-claim".into(),
                expression: condition,
            }]),
            namespace_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "kubernetes.io/metadata.name".into(),
                    operator: "NotIn".into(),
                    values: Some(vec!["kube-system".into(), opts.namespace.clone()]),
                }]),
                ..Default::default()
            }),
            failure_policy: Some("Fail".into()),
            side_effects: "None".into(),
            timeout_seconds: Some(10),
            reinvocation_policy: Some("Never".into()),
            ..Default::default()
        }]),
    }
}
