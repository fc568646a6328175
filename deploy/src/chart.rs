//! The Helm chart: the same typed objects as [`render`](crate::render), with
//! `tessera-manifests`' flags as the chart's values. A value is rendered as a sentinel and the
//! sentinel replaced with its template expression; an object that changes with a choice
//! (share enforcement, DRA, a driver root or none, exclusive-process mode) is rendered for
//! every choice, and each part that differs is put under the condition for which it applies. So the chart cannot say anything the
//! renderer does not (`deploy/tests/helm.rs` compares `helm template` with [`objects`] for
//! every choice).

use tessera_core::enforcement::ShareEnforcement;

use crate::image::IMAGE_PATTERN;
use crate::{EXTENDER, KEYS_SECRET, ManifestOptions, NODE, PUBLIC_KEYS_SECRET, SCHEDULER_NAME, objects, to_yaml};

/// Rendered in place of each value, then replaced with the value's template expression (the
/// replica count is a number, so its sentinel is one).
const SCALARS: &[(&str, &str)] = &[
    ("x-helm-namespace-x", "{{ .Release.Namespace }}"),
    ("x-helm-scheduler-image-x", "{{ .Values.schedulerImage }}"),
    ("x-helm-image-x", "{{ .Values.image }}"),
    ("/x-helm-nri-dir-x", "{{ dir .Values.nriSocket }}"),
    ("x-helm-nri-name-x", "{{ base .Values.nriSocket }}"),
    ("/x-helm-cdi-dir-x", "{{ .Values.cdiDir }}"),
    ("/x-helm-driver-root-x", "{{ .Values.driverRoot }}"),
    ("731904213", "{{ .Values.replicas }}"),
    ("731904214", "{{ .Values.percentageOfNodesToScore }}"),
];

/// One combination of the choices that change the objects' shape.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Choice {
    share_enforcement: ShareEnforcement,
    dra: bool,
    driver_root: bool,
    exclusive_process: bool,
}

/// How many dimensions a [`Choice`] has.
const DIMENSIONS: usize = 4;

const ENFORCEMENTS: [ShareEnforcement; 3] = [ShareEnforcement::Mps, ShareEnforcement::Hook, ShareEnforcement::None];

impl Choice {
    fn all() -> Vec<Choice> {
        let mut out = Vec::new();
        for share_enforcement in ENFORCEMENTS {
            for dra in [false, true] {
                for driver_root in [false, true] {
                    for exclusive_process in [false, true] {
                        // Exclusive-process mode is MPS's alone (the schema says so).
                        if exclusive_process && share_enforcement != ShareEnforcement::Mps {
                            continue;
                        }
                        out.push(Choice {
                            share_enforcement,
                            dra,
                            driver_root,
                            exclusive_process,
                        });
                    }
                }
            }
        }
        out
    }

    /// The sentinel options for this choice.
    fn options(self) -> ManifestOptions {
        ManifestOptions {
            namespace: "x-helm-namespace-x".into(),
            image: "x-helm-image-x".into(),
            scheduler_image: "x-helm-scheduler-image-x".into(),
            replicas: 731_904_213,
            driver_root: self.driver_root.then(|| "/x-helm-driver-root-x".into()),
            share_enforcement: self.share_enforcement,
            nri_socket: "/x-helm-nri-dir-x/x-helm-nri-name-x".into(),
            cdi_dir: "/x-helm-cdi-dir-x".into(),
            dra: self.dra,
            exclusive_process: self.exclusive_process,
            percentage_of_nodes_to_score: 731_904_214,
            ..ManifestOptions::default()
        }
    }

    /// The value of dimension `d` (0: share enforcement, 1: DRA, 2: driver root, 3:
    /// exclusive-process mode), as a template condition.
    fn atom(self, d: usize) -> String {
        let flag = |on: bool, value: &str| {
            if on {
                format!(".Values.{value}")
            } else {
                format!("(not .Values.{value})")
            }
        };
        match d {
            0 => format!("(eq .Values.shareEnforcement \"{}\")", self.share_enforcement),
            1 => flag(self.dra, "dra"),
            2 => flag(self.driver_root, "driverRoot"),
            _ => flag(self.exclusive_process, "exclusiveProcess"),
        }
    }

    fn differs_only_in(self, other: Choice, d: usize) -> bool {
        let same = [
            self.share_enforcement == other.share_enforcement,
            self.dra == other.dra,
            self.driver_root == other.driver_root,
            self.exclusive_process == other.exclusive_process,
        ];
        !same[d] && (0..DIMENSIONS).all(|i| i == d || same[i])
    }
}

/// `op` over `parts`, or the one part alone.
fn join(op: &str, parts: Vec<String>) -> String {
    if parts.len() == 1 {
        parts.into_iter().next().unwrap_or_default()
    } else {
        format!("({op} {})", parts.join(" "))
    }
}

/// Which choices (by index into [`Choice::all`]) something applies to.
type Set = Vec<bool>;

/// A value as the choices render it: the same under all, a mapping or sequence whose
/// entries each apply under some of them, or one value per group of choices.
#[derive(Debug)]
enum Tree {
    Same(serde_json::Value),
    Map(Vec<(String, Set, Tree)>),
    Seq(Vec<(Set, Tree)>),
    Switch(Vec<(Set, serde_json::Value)>),
}

/// How a sequence's items are matched across choices: by `name` (containers, volumes,
/// environment variables, ...) or, for scalars, by value. `None`: no identity.
fn identity(item: &serde_json::Value) -> Option<String> {
    match item {
        serde_json::Value::Object(o) => o.get("name").and_then(|n| n.as_str()).map(|n| format!("name={n}")),
        serde_json::Value::Array(_) => None,
        scalar => Some(scalar.to_string()),
    }
}

/// Merges `keys` into `order`: a key already there stays, a new one goes after the key that
/// precedes it in `keys`.
fn merge_order(order: &mut Vec<String>, keys: impl IntoIterator<Item = String>) {
    let mut previous: Option<usize> = None;
    for k in keys {
        let at = match order.iter().position(|o| *o == k) {
            Some(at) => at,
            None => {
                let at = previous.map_or(0, |p| p + 1);
                order.insert(at, k);
                at
            }
        };
        previous = Some(at);
    }
}

/// The tree of `values` (one per choice; those in `within` are present).
fn build(values: &[Option<&serde_json::Value>], within: &Set) -> Tree {
    use serde_json::Value;
    let present: Vec<&Value> = (0..values.len())
        .filter(|&i| within[i])
        .map(|i| values[i].expect("present within"))
        .collect();
    if present.windows(2).all(|w| w[0] == w[1]) {
        return Tree::Same(present[0].clone());
    }
    let member = |has: &dyn Fn(usize) -> bool| -> Set { (0..values.len()).map(|i| within[i] && has(i)).collect() };
    if present.iter().all(|v| v.is_object()) {
        let mut order = Vec::new();
        for v in &present {
            merge_order(&mut order, v.as_object().into_iter().flat_map(|o| o.keys().cloned()));
        }
        let entries = order
            .into_iter()
            .map(|k| {
                let child: Vec<Option<&Value>> = values.iter().map(|v| v.and_then(|v| v.get(&k))).collect();
                let set = member(&|i| child[i].is_some());
                let tree = build(&child, &set);
                (k, set, tree)
            })
            .collect();
        return Tree::Map(entries);
    }
    // Sequences whose items each have an identity, unique in its sequence.
    let identified = |v: &Value| -> Option<Vec<String>> {
        let ids: Vec<String> = v.as_array()?.iter().map(identity).collect::<Option<_>>()?;
        let unique = ids.iter().collect::<std::collections::BTreeSet<_>>().len() == ids.len();
        unique.then_some(ids)
    };
    if let Some(ids) = present.iter().map(|v| identified(v)).collect::<Option<Vec<_>>>() {
        let mut order = Vec::new();
        for i in ids {
            merge_order(&mut order, i);
        }
        let items = order
            .into_iter()
            .map(|id| {
                let child: Vec<Option<&Value>> = values
                    .iter()
                    .map(|v| v.and_then(|v| v.as_array()?.iter().find(|item| identity(item).as_ref() == Some(&id))))
                    .collect();
                let set = member(&|i| child[i].is_some());
                let tree = build(&child, &set);
                (set, tree)
            })
            .collect();
        return Tree::Seq(items);
    }
    let mut groups: Vec<(Set, Value)> = Vec::new();
    for i in (0..values.len()).filter(|&i| within[i]) {
        let v = values[i].expect("present within");
        match groups.iter_mut().find(|(_, g)| g == v) {
            Some((set, _)) => set[i] = true,
            None => {
                let mut set = vec![false; values.len()];
                set[i] = true;
                groups.push((set, v.clone()));
            }
        }
    }
    Tree::Switch(groups)
}

/// The template condition that holds, among the choices in `within`, for exactly those in
/// `set`: over the dimensions that tell them apart there.
fn condition(choices: &[Choice], set: &Set, within: &Set) -> String {
    let inside: Vec<usize> = (0..choices.len()).filter(|&i| within[i]).collect();
    let relevant: Vec<usize> = (0..DIMENSIONS)
        .filter(|&d| {
            inside.iter().any(|&a| {
                inside
                    .iter()
                    .any(|&b| choices[a].differs_only_in(choices[b], d) && set[a] != set[b])
            })
        })
        .collect();
    let term = |i: usize| join("and", relevant.iter().map(|&d| choices[i].atom(d)).collect());
    let mut terms: Vec<String> = Vec::new();
    for &i in inside.iter().filter(|&&i| set[i]) {
        let t = term(i);
        if !terms.contains(&t) {
            terms.push(t);
        }
    }
    for &i in inside.iter().filter(|&&i| !set[i]) {
        assert!(
            !terms.contains(&term(i)),
            "no condition tells {set:?} apart within {within:?}"
        );
    }
    join("or", terms)
}

/// `value` as YAML lines, each indented by `indent`.
fn lines(value: &serde_json::Value, indent: usize, out: &mut String) {
    for line in to_yaml(value).lines() {
        out.push_str(&" ".repeat(indent));
        out.push_str(line);
        out.push('\n');
    }
}

/// Writes `body`, under an `if` when `set` is narrower than `within`.
fn guarded(choices: &[Choice], set: &Set, within: &Set, out: &mut String, body: impl FnOnce(&mut String)) {
    if set == within {
        body(out);
    } else {
        out.push_str(&format!("{{{{- if {} }}}}\n", condition(choices, set, within)));
        body(out);
        out.push_str("{{- end }}\n");
    }
}

/// One `if` / `else if` chain, a branch per group.
fn switch(
    choices: &[Choice],
    groups: &[(Set, serde_json::Value)],
    within: &Set,
    out: &mut String,
    item: impl Fn(&serde_json::Value, &mut String),
) {
    for (n, (set, value)) in groups.iter().enumerate() {
        let keyword = if n == 0 { "if" } else { "else if" };
        out.push_str(&format!("{{{{- {keyword} {} }}}}\n", condition(choices, set, within)));
        item(value, out);
    }
    out.push_str("{{- end }}\n");
}

fn emit_map(choices: &[Choice], entries: &[(String, Set, Tree)], indent: usize, within: &Set, out: &mut String) {
    let pad = " ".repeat(indent);
    for (key, set, tree) in entries {
        guarded(choices, set, within, out, |out| {
            let entry = |v: &serde_json::Value, out: &mut String| lines(&serde_json::json!({ key: v }), indent, out);
            match tree {
                Tree::Same(v) => entry(v, out),
                Tree::Switch(groups) => switch(choices, groups, set, out, entry),
                Tree::Map(entries) => {
                    out.push_str(&format!("{pad}{key}:\n"));
                    emit_map(choices, entries, indent + 2, set, out);
                }
                Tree::Seq(items) => {
                    out.push_str(&format!("{pad}{key}:\n"));
                    emit_seq(choices, items, indent, set, out);
                }
            }
        });
    }
}

fn emit_seq(choices: &[Choice], items: &[(Set, Tree)], indent: usize, within: &Set, out: &mut String) {
    let pad = " ".repeat(indent);
    for (set, tree) in items {
        guarded(choices, set, within, out, |out| {
            let item = |v: &serde_json::Value, out: &mut String| lines(&serde_json::json!([v]), indent, out);
            match tree {
                Tree::Same(v) => item(v, out),
                Tree::Switch(groups) => switch(choices, groups, set, out, item),
                // A mapping's first line after the dash when it is there under every choice,
                // else the whole mapping on the lines after it.
                Tree::Map(entries) => {
                    let mut map = String::new();
                    emit_map(choices, entries, indent + 2, set, &mut map);
                    match map.strip_prefix(&format!("{pad}  ")) {
                        Some(rest) if !rest.starts_with([' ', '{']) => out.push_str(&format!("{pad}- {rest}")),
                        _ => out.push_str(&format!("{pad}-\n{map}")),
                    }
                }
                Tree::Seq(items) => {
                    out.push_str(&format!("{pad}-\n"));
                    emit_seq(choices, items, indent + 2, set, out);
                }
            }
        });
    }
}

fn key(object: &serde_json::Value) -> String {
    format!(
        "{}/{}",
        object["kind"].as_str().unwrap_or_default(),
        object["metadata"]["name"].as_str().unwrap_or_default()
    )
}

/// A template file's name: `kind-name`, lower case.
fn file_stem(key: &str) -> String {
    key.to_ascii_lowercase().replace(['/', '.'], "-")
}

/// Replaces every sentinel with its template expression.
fn templated(mut text: String) -> String {
    for (sentinel, template) in SCALARS {
        text = text.replace(sentinel, template);
    }
    assert!(!text.contains("x-helm-"), "a sentinel left in {text}");
    text
}

pub(crate) const RENDERED_BY: &str = "Rendered by `tessera-manifests --helm-chart`: change deploy/src and re-render.";

/// The chart's files (path inside the chart directory, content). `defaults` are the values
/// the chart starts from; their namespace is not used (a release has its own).
pub fn files(defaults: &ManifestOptions) -> Vec<(String, String)> {
    let choices = Choice::all();
    // Every object under every choice, keys in the order they are applied.
    let rendered: Vec<Vec<serde_json::Value>> = choices.iter().map(|c| objects(&c.options())).collect();
    let mut order: Vec<String> = Vec::new();
    for objects in &rendered {
        merge_order(&mut order, objects.iter().map(key));
    }
    let all: Set = vec![true; choices.len()];

    let mut out = vec![
        ("Chart.yaml".to_string(), chart_yaml()),
        ("values.yaml".to_string(), values_yaml(defaults)),
        ("values.schema.json".to_string(), values_schema()),
        ("templates/NOTES.txt".to_string(), notes(defaults)),
        ("templates/key-secrets-check.yaml".to_string(), key_secrets_check()),
    ];
    let mut n = 0;
    for k in &order {
        let per_choice: Vec<Option<&serde_json::Value>> = rendered
            .iter()
            .map(|objects| objects.iter().find(|o| key(o) == *k))
            .collect();
        let set: Set = per_choice.iter().map(Option::is_some).collect();
        let tree = build(&per_choice, &set);
        if k.starts_with("CustomResourceDefinition/") {
            let (Tree::Same(crd), true) = (&tree, set == all) else {
                panic!("{k} changes with the values: Helm does not template CRDs")
            };
            let text = format!("# {RENDERED_BY}\n{}", to_yaml(crd));
            out.push((format!("crds/{}.yaml", file_stem(k)), text));
            continue;
        }
        let mut body = format!("{{{{- /* {RENDERED_BY} */}}}}\n");
        guarded(&choices, &set, &all, &mut body, |out| match &tree {
            Tree::Map(entries) => emit_map(&choices, entries, 0, &set, out),
            Tree::Same(v) => lines(v, 0, out),
            other => panic!("{k}: an object that is not a mapping: {other:?}"),
        });
        out.push((format!("templates/{n:02}-{}.yaml", file_stem(k)), templated(body)));
        n += 1;
    }
    out
}

fn chart_yaml() -> String {
    let version = env!("CARGO_PKG_VERSION");
    format!(
        "# Rendered by `tessera-manifests --helm-chart`: change deploy/src and re-render.
apiVersion: v2
name: tessera
description: GPU sharing for Kubernetes - whole GPUs, fractions (compute % and memory) and MIG slices, enforced at the container runtime
type: application
version: {version}
appVersion: \"{version}\"
kubeVersion: \">=1.30.0-0\"
home: https://github.com/tessera-gpu/tessera
"
    )
}

/// What `helm install` and `helm upgrade` print after the release: the steps left, in order.
fn notes(d: &ManifestOptions) -> String {
    use tessera_core::names::{RESOURCE_GPU_CORE, RESOURCE_GPU_MEMORY};
    format!(
        "{{{{- /* {RENDERED_BY} */}}}}
Tessera {{{{ .Chart.AppVersion }}}} is installed in namespace {{{{ .Release.Namespace }}}} (share enforcement: {{{{ .Values.shareEnforcement }}}}{{{{ if .Values.dra }}}}, DRA driver {DRIVER}{{{{ end }}}}).
The hand-off key Secrets {KEYS_SECRET} and {PUBLIC_KEYS_SECRET} were checked.

Next:
1. On each GPU node, NRI must be on in the container runtime (deploy/runtime/ in the source) and the
   node labelled:  kubectl label node <gpu-node> {label}={value}
2. Wait for the agents:
     kubectl -n {{{{ .Release.Namespace }}}} rollout status deployment/{EXTENDER}
     kubectl -n {{{{ .Release.Namespace }}}} rollout status daemonset/{NODE}
3. Check a GPU node (NRI socket, runtime settings, CDI spec, driver, keys); every line should say ok:
     kubectl -n {{{{ .Release.Namespace }}}} exec <{NODE} pod on the node> -c nri-plugin -- \\
       tessera-nri-plugin check --host-root /host --containerd-config /host/etc/containerd/config.toml
4. Run a pod on a share: schedulerName: {SCHEDULER_NAME}, and resources limits
     {RESOURCE_GPU_CORE}: 30 and {RESOURCE_GPU_MEMORY}: 8 (GiB; docs/user-guide.md has more shapes)
5. See what each pod was given:  kubectl tessera inspect

Troubleshooting: docs/operations.md#troubleshooting
",
        DRIVER = tessera_core::dra::DRIVER,
        label = d.node_selector.0,
        value = d.node_selector.1,
    )
}

/// A template that renders nothing and fails the install or upgrade when the hand-off key
/// Secrets are missing or wrong: every pod would otherwise fail at creation (no key to verify
/// with), or any node could sign (a private key in the nodes' Secret). It asks the cluster, so
/// `helm template` and `helm lint`, which have none, skip it.
fn key_secrets_check() -> String {
    format!(
        r#"{{{{- /* {RENDERED_BY} */}}}}
{{{{- /* Asked only of a cluster: every cluster has kube-system, and offline lookups are empty. */}}}}
{{{{- if lookup "v1" "Namespace" "" "kube-system" }}}}
{{{{- $ns := .Release.Namespace }}}}
{{{{- $how := "create it before installing (docs/operations.md, Signing key)" }}}}
{{{{- $keys := lookup "v1" "Secret" $ns "{KEYS_SECRET}" }}}}
{{{{- if not $keys }}}}
{{{{- fail (printf "Secret %s/{KEYS_SECRET} (the extender's signing keys) does not exist: %s" $ns $how) }}}}
{{{{- end }}}}
{{{{- $data := default dict $keys.data }}}}
{{{{- $active := trim (b64dec (default "" (index $data "active"))) }}}}
{{{{- if not $active }}}}
{{{{- fail (printf "Secret %s/{KEYS_SECRET}: no active entry naming the key that signs (add --from-literal=active=<key id>)" $ns) }}}}
{{{{- end }}}}
{{{{- if not (hasKey $data $active) }}}}
{{{{- fail (printf "Secret %s/{KEYS_SECRET}: active names key %q, which it does not hold (it holds %s)" $ns $active (without (keys $data | sortAlpha) "active" | join ", ")) }}}}
{{{{- end }}}}
{{{{- $public := lookup "v1" "Secret" $ns "{PUBLIC_KEYS_SECRET}" }}}}
{{{{- if not $public }}}}
{{{{- fail (printf "Secret %s/{PUBLIC_KEYS_SECRET} (the keys the nodes verify with) does not exist: %s" $ns $how) }}}}
{{{{- end }}}}
{{{{- $verify := default dict $public.data }}}}
{{{{- range $id := keys $verify | sortAlpha }}}}
{{{{- if contains "PRIVATE KEY" (b64dec (index $verify $id)) }}}}
{{{{- fail (printf "Secret %s/{PUBLIC_KEYS_SECRET}: key %q is a private key, with which any node could sign; put its public half there (openssl pkey -in %s.pem -pubout)" $ns $id $id) }}}}
{{{{- end }}}}
{{{{- end }}}}
{{{{- if not (hasKey $verify $active) }}}}
{{{{- fail (printf "Secret %s/{PUBLIC_KEYS_SECRET}: no key %q, the active key's public half: the nodes could verify no new allocation" $ns $active) }}}}
{{{{- end }}}}
{{{{- end }}}}
"#
    )
}

fn values_yaml(d: &ManifestOptions) -> String {
    format!(
        "# Rendered by `tessera-manifests --helm-chart`: change deploy/src and re-render.
# The values are tessera-manifests' flags; the namespace is the release's (helm install -n).
# Before installing, create the namespace and the hand-off key Secret (docs/operations.md).

# The Tessera image (every binary).
image: {image}
# The kube-scheduler image of the `tessera` scheduler: match your cluster's version.
schedulerImage: {scheduler_image}
# Extender replicas.
replicas: {replicas}
# Host directory of the NVIDIA driver files; empty: each node detects it.
driverRoot: \"{driver_root}\"
# How GPU nodes hold shares to their limits: mps (adds the MPS supervisor), hook (Tessera's
# CUDA hook preloaded into share containers) or none.
shareEnforcement: {share}
# The container runtime's NRI socket on the GPU nodes.
nriSocket: {nri}
# Where the container runtime reads CDI specs on the GPU nodes.
cdiDir: {cdi}
# Also install Tessera as a DRA driver (Kubernetes 1.34+).
dra: {dra}
# With shareEnforcement mps: put the cards MPS serves in exclusive-process compute mode, so a
# process that goes around MPS is refused the card (costs: docs/operations.md).
exclusiveProcess: {exclusive}
# The share of the cluster's nodes the `tessera` scheduler looks at for each pod (0 to 100):
# 100, every node, lets the extender weigh every node that could take the pod; 0 is
# kube-scheduler's adaptive default, which leaves a pod unscheduled while the only cards that
# fit it lie on nodes it did not look at.
percentageOfNodesToScore: {percentage}
",
        image = d.image,
        scheduler_image = d.scheduler_image,
        replicas = d.replicas,
        driver_root = d.driver_root.as_deref().unwrap_or(""),
        share = d.share_enforcement,
        nri = d.nri_socket,
        cdi = d.cdi_dir,
        dra = d.dra,
        exclusive = d.exclusive_process,
        percentage = d.percentage_of_nodes_to_score,
    )
}

/// Helm refuses values outside these before rendering, naming the value; the patterns keep
/// every string a plain YAML scalar wherever it is put. Images are held to the rule
/// `tessera-manifests --image` applies ([`IMAGE_PATTERN`]).
fn values_schema() -> String {
    // No whitespace, quotes, backslashes or braces.
    const WORD: &str = r#"[^\s"'\\{}]"#;
    const LAST: &str = r#"[^\s"'\\{}/]"#;
    let path = format!("^/{WORD}*$");
    let schema = serde_json::json!({
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "Tessera chart values (tessera-manifests' flags)",
        "type": "object",
        "additionalProperties": false,
        "required": ["image", "schedulerImage", "replicas", "driverRoot", "shareEnforcement", "nriSocket", "cdiDir", "dra", "exclusiveProcess", "percentageOfNodesToScore"],
        // Exclusive-process mode only with MPS.
        "if": {"properties": {"exclusiveProcess": {"const": true}}},
        "then": {"properties": {"shareEnforcement": {"const": "mps", "description": "exclusiveProcess needs shareEnforcement mps"}}},
        "properties": {
            "image": {"type": "string", "pattern": IMAGE_PATTERN, "description": "The Tessera image"},
            "schedulerImage": {"type": "string", "pattern": IMAGE_PATTERN, "description": "The kube-scheduler image of the tessera scheduler"},
            "replicas": {"type": "integer", "minimum": 1, "description": "Extender replicas"},
            "driverRoot": {"type": "string", "pattern": format!("^(/{WORD}*)?$"), "description": "Host directory of the NVIDIA driver files (an absolute path), or empty"},
            "shareEnforcement": {"enum": ENFORCEMENTS.iter().map(|e| e.to_string()).collect::<Vec<_>>(), "description": "mps, hook or none"},
            "nriSocket": {"type": "string", "pattern": format!("^/{WORD}*{LAST}$"), "description": "The runtime's NRI socket (an absolute path)"},
            "cdiDir": {"type": "string", "pattern": path, "description": "Where the runtime reads CDI specs (an absolute path)"},
            "dra": {"type": "boolean", "description": "Also install Tessera as a DRA driver (Kubernetes 1.34+)"},
            "exclusiveProcess": {"type": "boolean", "description": "With MPS: the cards MPS serves in exclusive-process compute mode"},
            "percentageOfNodesToScore": {"type": "integer", "minimum": 0, "maximum": 100, "description": "The share of nodes the tessera scheduler looks at per pod (100: every node; 0: kube-scheduler's adaptive default)"}
        }
    });
    serde_json::to_string_pretty(&schema).expect("schema serializes") + "\n"
}
