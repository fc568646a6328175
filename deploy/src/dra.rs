//! The DRA install (`--dra`, Kubernetes 1.34+): the DeviceClasses users' claims name, the node
//! agents' rights to their own node's ResourceSlice and to read claims, and the policy that
//! keeps each node to its own slice.

use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MatchResources, NamedRuleWithOperations, ValidatingAdmissionPolicy, ValidatingAdmissionPolicySpec,
    Validation, Variable,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{CELDeviceSelector, DeviceClass, DeviceClassSpec, DeviceSelector};
use tessera_core::dra::DRIVER;

use super::build::{cluster_binding, meta, rule};
use super::guards::{NODE_NAME_EXTRA, deny_binding};
use super::{ManifestOptions, NODE};

/// The class of whole cards and shares of them (a claim that names no capacity gets a whole
/// card; `capacity.requests` of `cores` and `memory` make it a share).
pub const GPU_CLASS: &str = "gpu.tessera.io";
/// The class of whole cards asked for as an extended resource: a pod's `tessera.io/gpu: N`
/// limit is N whole cards through DRA (where the API server serves `extendedResourceName`,
/// beta in 1.36, GA in 1.37).
pub const WHOLE_CLASS: &str = "whole.gpu.tessera.io";
/// The extended resource [`WHOLE_CLASS`] answers.
pub const WHOLE_RESOURCE: &str = "tessera.io/gpu";
/// The class of carved MIG devices.
pub const MIG_CLASS: &str = "mig.gpu.tessera.io";
/// The node agents' DRA rights.
pub const NODE_DRA_ROLE: &str = "tessera-node-dra";
/// The policy (and its binding) keeping each node agent to its own ResourceSlice.
pub const OWN_SLICE_POLICY: &str = "tessera-node-own-slice";

fn class(name: &str, device_type: &str) -> DeviceClass {
    DeviceClass {
        metadata: meta(name, None),
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!(
                        "device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{device_type}'"
                    ),
                }),
            }]),
            ..Default::default()
        },
    }
}

/// The DeviceClasses.
pub fn device_classes() -> Vec<DeviceClass> {
    let mut whole = class(WHOLE_CLASS, "gpu");
    whole.spec.extended_resource_name = Some(WHOLE_RESOURCE.into());
    vec![class(GPU_CLASS, "gpu"), whole, class(MIG_CLASS, "mig")]
}

/// The node agents' rights: their node's ResourceSlice (kept to their own node by
/// [`own_slice_guard`]), reading the claims the kubelet asks them to prepare and their
/// namespaces.
pub fn node_rbac(opts: &ManifestOptions) -> (ClusterRole, ClusterRoleBinding) {
    let role = ClusterRole {
        metadata: meta(NODE_DRA_ROLE, None),
        rules: Some(vec![
            rule(
                &["resource.k8s.io"],
                &["resourceslices"],
                &["get", "list", "watch", "create", "update", "delete"],
            ),
            rule(&["resource.k8s.io"], &["resourceclaims"], &["get"]),
            // A claim's tenant (the namespace's tessera.io/tenant label), for one tenant per
            // card's shares.
            rule(&[""], &["namespaces"], &["get"]),
        ]),
        ..Default::default()
    };
    (
        role,
        cluster_binding(NODE_DRA_ROLE, NODE_DRA_ROLE, NODE, &opts.namespace),
    )
}

/// The node agents may write a ResourceSlice only for the node their token was issued on.
pub fn own_slice_guard(
    opts: &ManifestOptions,
) -> (
    ValidatingAdmissionPolicy,
    k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding,
) {
    let agent = format!("system:serviceaccount:{}:{NODE}", opts.namespace);
    let v = |s: &[&str]| Some(s.iter().map(|x| x.to_string()).collect::<Vec<_>>());
    let policy = ValidatingAdmissionPolicy {
        metadata: meta(OWN_SLICE_POLICY, None),
        spec: Some(ValidatingAdmissionPolicySpec {
            failure_policy: Some("Fail".into()),
            match_constraints: Some(MatchResources {
                resource_rules: Some(vec![NamedRuleWithOperations {
                    api_groups: v(&["resource.k8s.io"]),
                    api_versions: v(&["*"]),
                    operations: v(&["CREATE", "UPDATE", "DELETE"]),
                    resources: v(&["resourceslices"]),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            match_conditions: Some(vec![MatchCondition {
                name: "tessera-node-agent".into(),
                expression: format!("request.userInfo.username == '{agent}'"),
            }]),
            // The slice written, or for a deletion the one removed.
            variables: Some(vec![Variable {
                name: "slice".into(),
                expression: "request.operation == 'DELETE' ? oldObject : object".into(),
            }]),
            validations: Some(vec![Validation {
                expression: format!(
                    "'{NODE_NAME_EXTRA}' in request.userInfo.extra && \
                     variables.slice.spec.driver == '{DRIVER}' && \
                     has(variables.slice.spec.nodeName) && \
                     request.userInfo.extra['{NODE_NAME_EXTRA}'][0] == variables.slice.spec.nodeName && \
                     variables.slice.spec.pool.name == variables.slice.spec.nodeName"
                ),
                message: Some(format!(
                    "a Tessera node agent ({agent}) writes only its own node's {DRIVER} ResourceSlice"
                )),
                reason: Some("Forbidden".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    (policy, deny_binding(OWN_SLICE_POLICY))
}
