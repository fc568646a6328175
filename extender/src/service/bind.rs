//! The bind verb: choose the cards, reserve them, record the signed allocation on the pod,
//! then create the Binding. Any failure releases the reservation; a retry of the same pod gets
//! the same answer.

use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use kube::Api;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use tessera_core::handoff::Allocation;
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE, SCHEDULER_NAME};
use thiserror::Error;
use tracing::{info, warn};

use super::Service;
use super::events::PodRef;
use super::wire::ExtenderBindingArgs;

/// Why a bind failed.
#[derive(Debug, Error)]
pub enum BindError {
    /// This replica is not the leader.
    #[error("this extender replica is not the leader; only the leader binds")]
    NotLeader,
    /// The cluster has not been read completely yet.
    #[error("the extender is still reading the cluster")]
    NotSynced,
    /// The pod does not exist.
    #[error("pod {namespace}/{name} not found")]
    PodNotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The pod exists under another UID (deleted and recreated).
    #[error("pod {namespace}/{name} has UID {found}, not {wanted}")]
    UidMismatch {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The UID asked for.
        wanted: String,
        /// The UID found.
        found: String,
    },
    /// The pod is already bound elsewhere.
    #[error("pod is already bound to node {0:?}")]
    BoundElsewhere(String),
    /// The pod is another scheduler's: the extender binds only pods that name Tessera's.
    #[error("pod's schedulerName is {0:?}, not {SCHEDULER_NAME:?}: Tessera binds only its own pods")]
    ForeignScheduler(String),
    /// The node does not exist.
    #[error("node {0:?} not found")]
    NodeNotFound(String),
    /// The pod does not tolerate one of the node's taints.
    #[error("pod does not tolerate node {node:?}'s taint {taint}")]
    Untolerated {
        /// The node.
        node: String,
        /// The taint, as `key=value:effect`.
        taint: String,
    },
    /// The pod's request is invalid.
    #[error("invalid request: {0}")]
    Request(#[from] super::cluster::AskError),
    /// No room (or no such node), or the pod's claims do not allow it there.
    #[error(transparent)]
    Reserve(#[from] super::cluster::ReserveError),
    /// The bind task panicked (a bug); its reservation, if any, stays until the pod is seen.
    #[error("internal error: {0}")]
    Panicked(String),
    /// An API call failed.
    #[error("{step}: {source}")]
    Api {
        /// What we were doing.
        step: &'static str,
        /// The error.
        source: kube::Error,
    },
}

fn api_err(step: &'static str) -> impl FnOnce(kube::Error) -> BindError {
    move |source| BindError::Api { step, source }
}

/// Binds one pod; see the module docs.
pub async fn bind(svc: &Service, args: &ExtenderBindingArgs) -> Result<(), BindError> {
    if !svc.is_leader() {
        return Err(BindError::NotLeader);
    }
    if !svc.cluster.synced() {
        return Err(BindError::NotSynced);
    }
    let api: Api<Pod> = Api::namespaced(svc.client.clone(), &args.pod_namespace);
    let pod = current_pod(svc, &api, args).await?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
        Some(n) if n == args.node => return Ok(()),
        Some(n) => return Err(BindError::BoundElsewhere(n.to_string())),
        None => {}
    }
    // Only the scheduler that placed the pod may bind it, and only where it may run: a caller
    // of the verb (which the default scheduler's filters never saw) gets nothing more.
    let scheduler = pod
        .spec
        .as_ref()
        .and_then(|s| s.scheduler_name.as_deref())
        .unwrap_or("default-scheduler");
    if scheduler != SCHEDULER_NAME {
        return Err(BindError::ForeignScheduler(scheduler.to_string()));
    }
    let node = Api::<Node>::all(svc.client.clone())
        .get_opt(&args.node)
        .await
        .map_err(api_err("reading the node"))?
        .ok_or_else(|| BindError::NodeNotFound(args.node.clone()))?;
    let taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
    let tolerations = pod
        .spec
        .as_ref()
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default();
    let untolerated = tessera_core::taints::untolerated(&taints, &tolerations).map(|t| BindError::Untolerated {
        node: args.node.clone(),
        taint: format!("{}={}:{}", t.key, t.value.as_deref().unwrap_or(""), t.effect),
    });
    let who = PodRef {
        namespace: args.pod_namespace.clone(),
        name: args.pod_name.clone(),
        uid: uid.clone(),
    };
    let failed = |e: BindError| {
        svc.events.bind_failed(&svc.client, &who, &args.node, &e.to_string());
        e
    };
    if let Some(e) = untolerated {
        return Err(failed(e));
    }
    let ask = svc.cluster.ask(&pod).map_err(|e| failed(e.into()))?;
    let allocation = svc
        .cluster
        .reserve(&uid, &args.node, &ask)
        .map_err(|e| failed(e.into()))?;
    let result = record_and_bind(svc, &api, args, &uid, allocation.as_ref()).await;
    match result {
        Ok(()) => {
            svc.cluster.confirm(&uid);
            svc.events.bound(&svc.client, &who, &args.node, allocation.as_ref());
            info!(
                pod = args.pod_name,
                namespace = args.pod_namespace,
                node = args.node,
                "bound"
            );
            Ok(())
        }
        Err(e) => {
            // A binding that timed out may still have happened: then it is a success.
            if let Ok(Some(now)) = api.get_opt(&args.pod_name).await
                && now.metadata.uid.as_deref() == Some(uid.as_str())
                && now.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(args.node.as_str())
            {
                svc.cluster.confirm(&uid);
                svc.events.bound(&svc.client, &who, &args.node, allocation.as_ref());
                return Ok(());
            }
            warn!(pod = args.pod_name, namespace = args.pod_namespace, node = args.node, error = %e, "bind failed; reservation released");
            svc.cluster.release(&uid);
            // Losing the lease is not the pod's story.
            Err(match e {
                BindError::NotLeader => e,
                e => failed(e),
            })
        }
    }
}

/// The pod to bind: from the store, or from the API when the store has not seen this one yet;
/// refused when its UID is not the one the scheduler placed.
async fn current_pod(svc: &Service, api: &Api<Pod>, args: &ExtenderBindingArgs) -> Result<Pod, BindError> {
    let pod = match svc
        .pods
        .get(&ObjectRef::new(&args.pod_name).within(&args.pod_namespace))
    {
        Some(p) if p.metadata.uid.as_deref() == Some(args.pod_uid.as_str()) => (*p).clone(),
        // Not in the store yet (or an older object under the same name): ask the API.
        _ => api
            .get_opt(&args.pod_name)
            .await
            .map_err(api_err("reading the pod"))?
            .ok_or_else(|| BindError::PodNotFound {
                namespace: args.pod_namespace.clone(),
                name: args.pod_name.clone(),
            })?,
    };
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if uid != args.pod_uid {
        return Err(BindError::UidMismatch {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            wanted: args.pod_uid.clone(),
            found: uid,
        });
    }
    Ok(pod)
}

/// Records the signed allocation on the pod (when it has one) and creates its binding, while
/// this replica still leads.
async fn record_and_bind(
    svc: &Service,
    api: &Api<Pod>,
    args: &ExtenderBindingArgs,
    uid: &str,
    allocation: Option<&Allocation>,
) -> Result<(), BindError> {
    if let Some(a) = allocation {
        let signed = svc.cluster.keys().sign(a);
        let patch = serde_json::json!({
            "metadata": {
                "uid": uid,
                "annotations": {
                    ANNOTATION_ALLOCATION: signed.allocation,
                    ANNOTATION_ALLOCATION_SIGNATURE: signed.signature,
                }
            }
        });
        api.patch(&args.pod_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_err("recording the allocation on the pod"))?;
    }
    // Leadership may have moved while we patched; the new leader must not race us.
    if !svc.is_leader() {
        return Err(BindError::NotLeader);
    }
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(args.pod_name.clone()),
            namespace: Some(args.pod_namespace.clone()),
            uid: Some(uid.to_string()),
            ..Default::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(args.node.clone()),
            ..Default::default()
        },
    };
    api.create_subresource::<_, serde_json::Value>("binding", &args.pod_name, &PostParams::default(), &binding)
        .await
        .map_err(api_err("creating the binding"))?;
    Ok(())
}
