//! Whether a pod may be placed on a node for its taints, as kube-scheduler's TaintToleration
//! filter decides: every `NoSchedule` and `NoExecute` taint must be tolerated
//! (`PreferNoSchedule` only lowers a score).

use k8s_openapi::api::core::v1::{Taint, Toleration};

/// Whether `toleration` tolerates `taint` (Kubernetes' `ToleratesTaint`): the effect, when
/// given, and the key, when given, must match; `Exists` then matches any value, `Equal` (the
/// default) only the same value. Other operators tolerate nothing.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if toleration
        .effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
    {
        return false;
    }
    if toleration
        .key
        .as_deref()
        .is_some_and(|k| !k.is_empty() && k != taint.key)
    {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or("") {
        "" | "Equal" => toleration.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        "Exists" => true,
        _ => false,
    }
}

/// The first of `taints` that keeps a pod with `tolerations` off the node, if any.
pub fn untolerated<'a>(taints: &'a [Taint], tolerations: &[Toleration]) -> Option<&'a Taint> {
    taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            ..Default::default()
        }
    }

    fn toleration(key: Option<&str>, op: Option<&str>, value: Option<&str>, effect: Option<&str>) -> Toleration {
        Toleration {
            key: key.map(Into::into),
            operator: op.map(Into::into),
            value: value.map(Into::into),
            effect: effect.map(Into::into),
            ..Default::default()
        }
    }

    #[test]
    fn as_kube_scheduler_decides() {
        let control_plane = taint("node-role.kubernetes.io/control-plane", None, "NoSchedule");
        let gpu = taint("nvidia.com/gpu", Some("present"), "NoSchedule");
        let soft = taint("busy", None, "PreferNoSchedule");
        let evict = taint("maintenance", Some("now"), "NoExecute");
        let taints = [soft.clone(), gpu.clone()];
        // No toleration: the GPU taint keeps the pod off; the soft one never does.
        assert_eq!(untolerated(&taints, &[]), Some(&gpu));
        assert_eq!(untolerated(std::slice::from_ref(&soft), &[]), None);
        // Equal needs the value; Exists any; the effect must match when given.
        let equal = toleration(Some("nvidia.com/gpu"), None, Some("present"), None);
        let wrong_value = toleration(Some("nvidia.com/gpu"), Some("Equal"), Some("absent"), None);
        let exists = toleration(Some("nvidia.com/gpu"), Some("Exists"), None, Some("NoSchedule"));
        let wrong_effect = toleration(Some("nvidia.com/gpu"), Some("Exists"), None, Some("NoExecute"));
        assert_eq!(untolerated(&taints, std::slice::from_ref(&equal)), None);
        assert_eq!(untolerated(&taints, std::slice::from_ref(&wrong_value)), Some(&gpu));
        assert_eq!(untolerated(&taints, std::slice::from_ref(&exists)), None);
        assert_eq!(untolerated(&taints, std::slice::from_ref(&wrong_effect)), Some(&gpu));
        // An empty key with Exists tolerates everything (DaemonSets' catch-all).
        let all = toleration(None, Some("Exists"), None, None);
        assert_eq!(
            untolerated(&[control_plane.clone(), gpu.clone(), evict.clone()], &[all]),
            None
        );
        // NoExecute counts; an unknown operator tolerates nothing.
        assert_eq!(untolerated(std::slice::from_ref(&evict), &[]), Some(&evict));
        let lt = toleration(Some("maintenance"), Some("Lt"), Some("z"), None);
        assert_eq!(untolerated(std::slice::from_ref(&evict), &[lt]), Some(&evict));
    }
}
