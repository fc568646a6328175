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

impl FilterReply<'_> {
    /// The reply's JSON: the bytes `serde_json` writes for it, written directly. A filter of a
    /// busy cluster refuses thousands of nodes for a few dozen reasons, shared texts
    /// ([`tessera_core::placement`] gives one per reason): each is made fit for the scheduler
    /// ([`no_percent_sign`]) and escaped once, and copied for the other nodes it refuses.
    pub fn to_json(&self) -> Vec<u8> {
        let names: usize = self.node_names.iter().flatten().map(|n| n.len() + 3).sum();
        let failed = self.failed_nodes.len() + self.failed_and_unresolvable_nodes.len();
        let mut out = Vec::with_capacity(128 + names + failed * 96);
        out.extend_from_slice(br#"{"Nodes":"#);
        serde_json::to_writer(&mut out, &self.nodes).expect("a node list serializes");
        out.extend_from_slice(br#","NodeNames":"#);
        match &self.node_names {
            None => out.extend_from_slice(b"null"),
            Some(names) => {
                out.push(b'[');
                for (i, name) in names.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    push_json_str(&mut out, name);
                }
                out.push(b']');
            }
        }
        // Where each reason's JSON was first written, by the text's address and length (the
        // reply holds every text it names, so no address is reused while it is written).
        let mut written: rustc_hash::FxHashMap<(usize, usize), std::ops::Range<usize>> = Default::default();
        for (key, map) in [
            (&br#","FailedNodes":"#[..], &self.failed_nodes),
            (
                br#","FailedAndUnresolvableNodes":"#,
                &self.failed_and_unresolvable_nodes,
            ),
        ] {
            out.extend_from_slice(key);
            out.push(b'{');
            for (i, (name, reason)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                push_json_str(&mut out, name);
                out.push(b':');
                let id = (reason.as_ptr() as usize, reason.len());
                match written.get(&id) {
                    Some(at) => out.extend_from_within(at.clone()),
                    None => {
                        let from = out.len();
                        push_json_str(&mut out, &no_percent_sign(reason));
                        written.insert(id, from..out.len());
                    }
                }
            }
            out.push(b'}');
        }
        out.extend_from_slice(br#","Error":"#);
        push_json_str(&mut out, &no_percent_sign(&self.error));
        out.push(b'}');
        out
    }
}

/// `s` as a JSON string. Node names are DNS names, and reasons plain text: nothing to escape,
/// so the check is one pass with no branch per byte. Any other text goes through serde_json.
fn push_json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("a string serializes");
    }
}

/// The prioritize reply's JSON: the bytes `serde_json` writes for `scores`, written directly.
/// A reply can name every node that fits (142 KB at 5,000 nodes): `serde_json` takes 0.13 ms
/// over it, most of it checking every byte of every name for escapes, and this 0.05 ms.
pub fn host_scores_json(scores: &[HostScore<'_>]) -> Vec<u8> {
    const ENTRY: usize = r#"{"Host":"","Score":10},"#.len();
    let names: usize = scores.iter().map(|h| h.host.len()).sum();
    let mut out = Vec::with_capacity(2 + names + scores.len() * ENTRY);
    let mut digits = itoa::Buffer::new();
    out.push(b'[');
    for (i, h) in scores.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"Host":"#);
        push_json_str(&mut out, h.host);
        out.extend_from_slice(br#","Score":"#);
        out.extend_from_slice(digits.format(h.score).as_bytes());
        out.push(b'}');
    }
    out.push(b']');
    out
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

    /// The prioritize reply written directly is serde_json's, byte for byte, whatever the
    /// names (quotes, backslashes, control characters, non-ASCII) and scores.
    #[test]
    fn host_scores_are_written_as_serde_json_writes_them() {
        let names = [
            "n00001",
            "",
            "a\"b",
            "back\\slash",
            "tab\there",
            "nul\u{0}",
            "del\u{7f}",
            "é-ü-节点",
            "\u{1f}x",
        ];
        let scores = [0, 10, -1, 7, i64::MAX, i64::MIN, 3, 5, 9];
        for n in 0..=names.len() {
            let list: Vec<HostScore> = names[..n]
                .iter()
                .zip(scores)
                .map(|(&host, score)| HostScore { host, score })
                .collect();
            assert_eq!(
                String::from_utf8(host_scores_json(&list)).unwrap(),
                serde_json::to_string(&list).unwrap(),
                "{n} entries"
            );
        }
    }

    #[test]
    fn a_filter_reply_written_directly_is_serde_jsons_bytes() {
        let shared: Arc<str> = "best card has 20% core, 8 GiB free; needs 30%, 8 GiB".into();
        // The same text in another allocation, one that needs escaping, and one of the same
        // length as the shared one at another address.
        let copy: Arc<str> = shared.to_string().into();
        let quoted: Arc<str> = "say \"no\"\\\n\u{1}50%".into();
        let same_len: Arc<str> = "x".repeat(shared.len()).into();
        let names = ["n1", "n\"2", "n\\3", "n\u{7}4", "nødé-5"];
        let mut replies = vec![FilterReply::default()];
        for n in 0..=names.len() {
            let reasons = [&shared, &copy, &quoted, &shared, &same_len, &shared];
            replies.push(FilterReply {
                nodes: (n == 2).then(NodeList::default),
                node_names: (n != 3).then(|| names[..n].to_vec()),
                failed_nodes: names[..n].iter().zip(reasons).map(|(&k, r)| (k, r.clone())).collect(),
                failed_and_unresolvable_nodes: names[n..]
                    .iter()
                    .zip(reasons.into_iter().rev())
                    .map(|(&k, r)| (k, r.clone()))
                    .collect(),
                error: ["", "100% \"wrong\""][n % 2].into(),
            });
        }
        for reply in &replies {
            assert_eq!(
                String::from_utf8(reply.to_json()).unwrap(),
                serde_json::to_string(reply).unwrap(),
                "{reply:?}"
            );
        }
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
        let json: serde_json::Value = serde_json::from_slice(&reply.to_json()).unwrap();
        assert_eq!(
            json["FailedNodes"]["n1"],
            "best card has 50 percent core, 5 GiB free; needs 60 percent, 6 GiB"
        );
        assert_eq!(json["FailedAndUnresolvableNodes"]["n2"], "plain");
        assert_eq!(json["Error"], "100 percent wrong");
    }
}
