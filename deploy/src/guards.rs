//! Admission policies that keep Tessera's own records to Tessera: only the extender's service
//! account sets or changes a pod's signed allocation (`tessera.io/allocation` and its
//! signature) — a tenant who may update its pods could otherwise drop its allocation from a
//! restarted extender's books while its node keeps the devices it injected — a node agent
//! changes only its own Node (one node cannot rewrite another's published GPUs), and the
//! extender writes only its certificates' Secrets.

use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MatchResources, NamedRuleWithOperations, ValidatingAdmissionPolicy,
    ValidatingAdmissionPolicyBinding, ValidatingAdmissionPolicyBindingSpec, ValidatingAdmissionPolicySpec, Validation,
    Variable,
};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

use super::build::meta;
use super::{EXTENDER, ManifestOptions, NODE};

/// Requests of `operations` on core/v1 `resources` (a pod's or Node's status subresource may
/// change its annotations too, so policies name it).
fn core_v1(operations: &[&str], resources: &[&str]) -> MatchResources {
    let v = |s: &[&str]| Some(s.iter().map(|x| x.to_string()).collect());
    MatchResources {
        resource_rules: Some(vec![NamedRuleWithOperations {
            api_groups: v(&[""]),
            api_versions: v(&["v1"]),
            operations: v(operations),
            resources: v(resources),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// Binds `policy` to every request it matches, denying what it refuses.
pub(crate) fn deny_binding(policy: &str) -> ValidatingAdmissionPolicyBinding {
    ValidatingAdmissionPolicyBinding {
        metadata: meta(policy, None),
        spec: Some(ValidatingAdmissionPolicyBindingSpec {
            policy_name: Some(policy.into()),
            validation_actions: Some(vec!["Deny".into()]),
            ..Default::default()
        }),
    }
}

/// The policy (and its binding) guarding the allocation annotations.
pub const ALLOCATION_POLICY: &str = "tessera-allocation-annotations";

/// An annotation of `object` (or of `oldObject`), `''` when absent: CEL with no optionals, so
/// every API server from 1.30 on evaluates it.
fn annotation(object: &str, key: &str) -> String {
    let guard = if object == "oldObject" {
        "oldObject != null && "
    } else {
        ""
    };
    format!(
        "{guard}has({object}.metadata.annotations) && '{key}' in {object}.metadata.annotations ? {object}.metadata.annotations['{key}'] : ''"
    )
}

/// The policy and its binding, in apply order.
pub fn allocation_guard(opts: &ManifestOptions) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
    let variable = |name: &str, expression: String| Variable {
        name: name.into(),
        expression,
    };
    let extender = format!("system:serviceaccount:{}:{EXTENDER}", opts.namespace);
    let policy = ValidatingAdmissionPolicy {
        metadata: meta(ALLOCATION_POLICY, None),
        spec: Some(ValidatingAdmissionPolicySpec {
            failure_policy: Some("Fail".into()),
            match_constraints: Some(core_v1(&["CREATE", "UPDATE"], &["pods", "pods/status"])),
            variables: Some(vec![
                variable("allocation", annotation("object", ANNOTATION_ALLOCATION)),
                variable("signature", annotation("object", ANNOTATION_ALLOCATION_SIGNATURE)),
                variable("oldAllocation", annotation("oldObject", ANNOTATION_ALLOCATION)),
                variable("oldSignature", annotation("oldObject", ANNOTATION_ALLOCATION_SIGNATURE)),
            ]),
            validations: Some(vec![Validation {
                expression: format!(
                    "request.userInfo.username == '{extender}' || \
                     (variables.allocation == variables.oldAllocation && variables.signature == variables.oldSignature)"
                ),
                message: Some(format!(
                    "only Tessera's extender ({extender}) sets or changes {ANNOTATION_ALLOCATION} and {ANNOTATION_ALLOCATION_SIGNATURE}"
                )),
                reason: Some("Forbidden".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    (policy, deny_binding(ALLOCATION_POLICY))
}

/// The policy (and its binding) keeping each node agent to its own Node.
pub const OWN_NODE_POLICY: &str = "tessera-node-own-node";

/// The node-name a pod's service-account token carries (Kubernetes 1.30 on).
pub(crate) const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// The node agents' service account may change a Node only when it is the node its token was
/// issued on: the token of a pod carries its node's name.
pub fn own_node_guard(opts: &ManifestOptions) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
    let agent = format!("system:serviceaccount:{}:{NODE}", opts.namespace);
    let policy = ValidatingAdmissionPolicy {
        metadata: meta(OWN_NODE_POLICY, None),
        spec: Some(ValidatingAdmissionPolicySpec {
            failure_policy: Some("Fail".into()),
            match_constraints: Some(core_v1(&["UPDATE"], &["nodes", "nodes/status"])),
            match_conditions: Some(vec![MatchCondition {
                name: "tessera-node-agent".into(),
                expression: format!("request.userInfo.username == '{agent}'"),
            }]),
            validations: Some(vec![Validation {
                expression: format!(
                    "'{NODE_NAME_EXTRA}' in request.userInfo.extra && \
                     request.userInfo.extra['{NODE_NAME_EXTRA}'][0] == object.metadata.name"
                ),
                message: Some(format!(
                    "{agent} changes only the Node its token was issued on ({NODE_NAME_EXTRA})"
                )),
                reason: Some("Forbidden".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    (policy, deny_binding(OWN_NODE_POLICY))
}

/// The policy (and its binding) keeping the extender's Secret writes to its certificates.
pub const EXTENDER_SECRETS_POLICY: &str = "tessera-extender-secrets";

/// The extender's service account may create any Secret (creation cannot be limited by name in
/// RBAC) and read its certificates' Secrets: this keeps what it writes to `kubernetes.io/tls`
/// Secrets of those names, so its token cannot, say, make a service-account token Secret under
/// a name it may read.
pub fn extender_secrets_guard(opts: &ManifestOptions) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
    let extender = format!("system:serviceaccount:{}:{EXTENDER}", opts.namespace);
    let names = [
        super::claims::WEBHOOK_SECRET,
        super::EXTENDER_TLS_SECRET,
        super::SCHEDULER_TLS_SECRET,
    ];
    let list = names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
    let policy = ValidatingAdmissionPolicy {
        metadata: meta(EXTENDER_SECRETS_POLICY, None),
        spec: Some(ValidatingAdmissionPolicySpec {
            failure_policy: Some("Fail".into()),
            match_constraints: Some(core_v1(&["CREATE", "UPDATE"], &["secrets"])),
            match_conditions: Some(vec![MatchCondition {
                name: "tessera-extender".into(),
                expression: format!("request.userInfo.username == '{extender}'"),
            }]),
            validations: Some(vec![Validation {
                expression: format!(
                    "object.metadata.namespace == '{ns}' && object.metadata.name in [{list}] && \
                     has(object.type) && object.type == 'kubernetes.io/tls'",
                    ns = opts.namespace
                ),
                message: Some(format!(
                    "{extender} writes only its certificates: kubernetes.io/tls Secrets {list} in {}",
                    opts.namespace
                )),
                reason: Some("Forbidden".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    (policy, deny_binding(EXTENDER_SECRETS_POLICY))
}
