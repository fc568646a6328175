//! kube-scheduler's extender v1 JSON (`k8s.io/kube-scheduler/extender/v1`): PascalCase keys
//! (the Go structs have no json tags), embedded objects in ordinary Kubernetes JSON, usually
//! without `apiVersion`/`kind`. Go decodes keys case-insensitively, so lowerCamel is accepted too.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};

/// The highest prioritize score.
pub const MAX_PRIORITY: i64 = 10;

/// A node list as the scheduler sends it (`{"metadata":{},"items":[...]}`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeList {
    /// List metadata (empty).
    #[serde(default)]
    pub metadata: serde_json::Value,
    /// The nodes.
    #[serde(default)]
    pub items: Vec<Node>,
}

/// Filter and prioritize request (`ExtenderArgs`). Node names are borrowed from the request
/// body: a request names every candidate node, thousands of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs<'a> {
    /// The pod being scheduled.
    #[serde(alias = "pod")]
    pub pod: Pod,
    /// Candidate nodes (when the extender is not node-cache capable).
    #[serde(default, alias = "nodes")]
    pub nodes: Option<NodeList>,
    /// Candidate node names (when node-cache capable).
    #[serde(default, borrow, alias = "nodeNames", alias = "nodenames")]
    pub node_names: Option<Vec<NodeName<'a>>>,
}

/// A node name in a request, borrowed from the body unless it had to be unescaped.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct NodeName<'a>(#[serde(borrow)] pub Cow<'a, str>);

impl AsRef<str> for NodeName<'_> {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl ExtenderArgs<'_> {
    /// The candidate names, from whichever form was sent.
    pub fn candidates(&self) -> Vec<&str> {
        if let Some(names) = &self.node_names {
            return names.iter().map(|n| n.as_ref()).collect();
        }
        self.nodes
            .iter()
            .flat_map(|l| &l.items)
            .filter_map(|n| n.metadata.name.as_deref())
            .collect()
    }
}

/// A filter reply as the extender writes it, borrowing node names from the request: the same
/// JSON as [`ExtenderFilterResult`].
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct FilterReply<'a> {
    /// Feasible nodes as objects (answering a `Nodes` request).
    pub nodes: Option<NodeList>,
    /// Feasible node names (answering a `NodeNames` request).
    pub node_names: Option<Vec<&'a str>>,
    /// Nodes that do not fit now, with why (preemption may help).
    #[serde(serialize_with = "as_map")]
    pub failed_nodes: Vec<(&'a str, Arc<str>)>,
    /// Nodes that can never fit this pod (preemption will not help).
    #[serde(serialize_with = "as_map")]
    pub failed_and_unresolvable_nodes: Vec<(&'a str, Arc<str>)>,
    /// A non-empty error fails the whole call.
    #[serde(serialize_with = "as_text")]
    pub error: String,
}

fn as_text<S: serde::Serializer>(v: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&no_percent_sign(v))
}

fn as_map<S: serde::Serializer>(v: &[(&str, Arc<str>)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(v.iter().map(|(k, r)| (k, no_percent_sign(r))))
}

/// A reason as the scheduler can show it: kube-scheduler records an extender's reasons in the
/// pod's FailedScheduling event as a format string, so `50% core` would read `50%!c(MISSING)ore`.
pub fn no_percent_sign(reason: &str) -> std::borrow::Cow<'_, str> {
    if reason.contains('%') {
        reason.replace('%', " percent").into()
    } else {
        reason.into()
    }
}

/// A prioritize entry as the extender writes it (the same JSON as [`HostPriority`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostScore<'a> {
    /// Node name.
    pub host: &'a str,
    /// 0..=[`MAX_PRIORITY`].
    pub score: i64,
}

/// Filter reply (`ExtenderFilterResult`). Every key is always written; `NodeNames` is an
/// array whenever the request carried names (null would mean "no node fits" in any case).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    /// Feasible nodes as objects (answering a `Nodes` request).
    pub nodes: Option<NodeList>,
    /// Feasible node names (answering a `NodeNames` request).
    pub node_names: Option<Vec<String>>,
    /// Nodes that do not fit now, with why (preemption may help).
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes that can never fit this pod (preemption will not help).
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// A non-empty error fails the whole call.
    pub error: String,
}

/// One prioritize entry (`HostPriority`); the reply is a bare array of these.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority {
    /// Node name.
    #[serde(alias = "host")]
    pub host: String,
    /// 0..=[`MAX_PRIORITY`].
    #[serde(alias = "score")]
    pub score: i64,
}

/// Bind request (`ExtenderBindingArgs`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    /// Pod name.
    #[serde(alias = "podName")]
    pub pod_name: String,
    /// Pod namespace.
    #[serde(alias = "podNamespace")]
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID", alias = "podUID", alias = "PodUid")]
    pub pod_uid: String,
    /// The chosen node.
    #[serde(alias = "node")]
    pub node: String,
}

/// Bind reply (`ExtenderBindingResult`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    /// Empty on success.
    pub error: String,
}

/// A victim referred to by UID (`MetaPod`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    /// Pod UID.
    #[serde(rename = "UID", alias = "uid")]
    pub uid: String,
}

/// Victims on one node by UID (`MetaVictims`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct MetaVictims {
    /// The pods to evict.
    #[serde(default, alias = "pods")]
    pub pods: Vec<MetaPod>,
    /// How many of them violate a PodDisruptionBudget.
    #[serde(default, rename = "NumPDBViolations", alias = "numPDBViolations")]
    pub num_pdb_violations: i64,
}

/// Victims on one node as objects (`Victims`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct Victims {
    /// The pods to evict.
    #[serde(default, alias = "pods")]
    pub pods: Vec<Pod>,
    /// How many of them violate a PodDisruptionBudget.
    #[serde(default, rename = "NumPDBViolations", alias = "numPDBViolations")]
    pub num_pdb_violations: i64,
}

/// Preempt request (`ExtenderPreemptionArgs`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionArgs {
    /// The preemptor.
    #[serde(alias = "pod")]
    pub pod: Pod,
    /// Candidates with victims as objects (not node-cache capable).
    #[serde(default, alias = "nodeNameToVictims")]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// Candidates with victims by UID (node-cache capable).
    #[serde(default, alias = "nodeNameToMetaVictims")]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

impl ExtenderPreemptionArgs {
    /// The candidates with their victims by UID, from whichever form was sent.
    pub fn candidates(&self) -> BTreeMap<String, MetaVictims> {
        if let Some(m) = &self.node_name_to_meta_victims {
            return m.clone();
        }
        self.node_name_to_victims
            .iter()
            .flatten()
            .map(|(node, v)| {
                let pods = v
                    .pods
                    .iter()
                    .filter_map(|p| p.metadata.uid.clone())
                    .map(|uid| MetaPod { uid })
                    .collect();
                (
                    node.clone(),
                    MetaVictims {
                        pods,
                        num_pdb_violations: v.num_pdb_violations,
                    },
                )
            })
            .collect()
    }
}

/// Preempt reply (`ExtenderPreemptionResult`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionResult {
    /// The candidates kept, with the victims that must go.
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

/// The body of a 4xx/5xx reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ErrorReply {
    /// What went wrong.
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_borrowed_from_the_body_unless_escaped() {
        let body = br#"{"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["n1", "n\u0032"]}"#;
        let args: ExtenderArgs = serde_json::from_slice(body).unwrap();
        let names = args.node_names.as_ref().unwrap();
        assert!(matches!(names[0].0, Cow::Borrowed("n1")));
        assert!(matches!(&names[1].0, Cow::Owned(n) if n == "n2"));
        assert_eq!(args.candidates(), ["n1", "n2"]);
    }

    /// The scheduler shows reasons through a format string: none carries a `%`.
    #[test]
    fn reasons_reach_the_scheduler_without_percent_signs() {
        let reason: Arc<str> = "best card has 50% core, 5 GiB free; needs 60%, 6 GiB".into();
        let reply = FilterReply {
            failed_nodes: vec![("n1", reason.clone())],
            failed_and_unresolvable_nodes: vec![("n2", "plain".into())],
            error: "100% wrong".into(),
            ..Default::default()
        };
        let json = serde_json::to_value(&reply).unwrap();
        assert_eq!(
            json["FailedNodes"]["n1"],
            "best card has 50 percent core, 5 GiB free; needs 60 percent, 6 GiB"
        );
        assert_eq!(json["FailedAndUnresolvableNodes"]["n2"], "plain");
        assert_eq!(json["Error"], "100 percent wrong");
    }
}
