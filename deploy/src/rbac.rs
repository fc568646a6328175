//! Who may do what: the service accounts, their roles and bindings, and the admission
//! policies that narrow what RBAC cannot.

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};

use crate::build::{Objects, cluster_binding, meta, role_binding, rule};
use crate::{EXTENDER, ManifestOptions, NODE, SCHEDULER, claims, dra, guards};

/// The service accounts, then each one's rights, in apply order.
pub(crate) fn objects(opts: &ManifestOptions, out: &mut Objects) {
    let ns = opts.namespace.as_str();
    // No Namespace: it is created before the key Secret (README), and `kubectl delete -f`
    // of these manifests then leaves the namespace and its key in place.
    for sa in [EXTENDER, SCHEDULER, NODE] {
        out.push(&ServiceAccount {
            metadata: meta(sa, Some(ns)),
            ..Default::default()
        });
    }

    // Extender: read nodes and pods, annotate and bind pods, its own Lease.
    out.push(&ClusterRole {
        metadata: meta(EXTENDER, None),
        rules: Some(
            vec![
                rule(&[""], &["nodes"], &["get", "list", "watch"]),
                rule(&[""], &["pods"], &["get", "list", "watch", "patch"]),
                // Which tenant each namespace's pods belong to (tessera.io/tenant).
                rule(&[""], &["namespaces"], &["list", "watch"]),
                rule(&[""], &["pods/binding"], &["create"]),
                rule(&[""], &["events"], &["create", "patch"]),
            ]
            .into_iter()
            .chain(claims::extender_rules())
            .collect(),
        ),
        ..Default::default()
    });
    out.push(&cluster_binding(EXTENDER, EXTENDER, EXTENDER, ns));
    // Only the extender writes the signed allocation.
    let (policy, binding) = guards::allocation_guard(opts);
    out.push(&policy);
    out.push(&binding);
    // A node agent changes only its own Node.
    let (policy, binding) = guards::own_node_guard(opts);
    out.push(&policy);
    out.push(&binding);
    // The extender writes only its certificates' Secrets.
    let (policy, binding) = guards::extender_secrets_guard(opts);
    out.push(&policy);
    out.push(&binding);
    if opts.dra {
        for class in dra::device_classes() {
            out.push(&class);
        }
        let (role, binding) = dra::node_rbac(opts);
        out.push(&role);
        out.push(&binding);
        let (policy, binding) = dra::own_slice_guard(opts);
        out.push(&policy);
        out.push(&binding);
    }
    out.push(&Role {
        metadata: meta(&format!("{EXTENDER}-lease"), Some(ns)),
        rules: Some(
            std::iter::once(rule(
                &["coordination.k8s.io"],
                &["leases"],
                &["get", "create", "update"],
            ))
            .chain(claims::extender_namespace_rules())
            .collect(),
        ),
    });
    out.push(&role_binding(
        &format!("{EXTENDER}-lease"),
        ns,
        "Role",
        &format!("{EXTENDER}-lease"),
        EXTENDER,
        ns,
    ));

    // The second scheduler: kube-scheduler's own roles, plus its Lease here.
    for role in ["system:kube-scheduler", "system:volume-scheduler"] {
        let name = format!("{SCHEDULER}-{}", role.trim_start_matches("system:"));
        out.push(&cluster_binding(&name, role, SCHEDULER, ns));
    }
    out.push(&role_binding(
        &format!("{SCHEDULER}-auth-reader"),
        "kube-system",
        "Role",
        "extension-apiserver-authentication-reader",
        SCHEDULER,
        ns,
    ));
    out.push(&Role {
        metadata: meta(&format!("{SCHEDULER}-lease"), Some(ns)),
        rules: Some(vec![rule(
            &["coordination.k8s.io"],
            &["leases"],
            &["get", "create", "update"],
        )]),
    });
    out.push(&role_binding(
        &format!("{SCHEDULER}-lease"),
        ns,
        "Role",
        &format!("{SCHEDULER}-lease"),
        SCHEDULER,
        ns,
    ));

    // Node agents: publish the inventory annotation on their own node.
    out.push(&ClusterRole {
        metadata: meta(NODE, None),
        rules: Some(vec![rule(&[""], &["nodes"], &["get", "patch"])]),
        ..Default::default()
    });
    out.push(&cluster_binding(NODE, NODE, NODE, ns));
}
