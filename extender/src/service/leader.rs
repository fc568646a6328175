//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it:
//! the holder renews the lease; another replica takes it over once it has *observed* the record
//! unchanged for the lease's duration (its own clock, so clock skew between replicas does not
//! matter); every write is a compare-and-swap on `resourceVersion`. Only the leader binds.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tracing::{info, warn};

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Lease name.
    pub name: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// How long a lease is valid without renewal.
    pub lease_duration: Duration,
    /// A leader that could not renew for this long steps down (less than `lease_duration`).
    pub renew_deadline: Duration,
    /// Time between attempts.
    pub retry_period: Duration,
    /// Label this replica's own pod (named `identity`, in `namespace`) with its role, so the
    /// Service can select the leader ([`LABEL_EXTENDER_ROLE`](tessera_core::names::LABEL_EXTENDER_ROLE)).
    pub label_pod: bool,
}

impl LeaseConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry.
    pub fn new(namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            label_pod: false,
        }
    }
}

/// What was last seen of the record and when (our clock).
struct Observed {
    holder: Option<String>,
    renew: Option<MicroTime>,
    at: Instant,
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

struct Elector {
    api: Api<Lease>,
    cfg: LeaseConfig,
    observed: Option<Observed>,
}

impl Elector {
    /// One attempt to acquire or renew; true when we hold the lease afterwards.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let duration_s = self.cfg.lease_duration.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.cfg.name.clone()),
                    namespace: Some(self.cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.cfg.identity.clone()),
                    lease_duration_seconds: Some(duration_s),
                    acquire_time: Some(now()),
                    renew_time: Some(now()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return conflict_is_false(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let changed = self
            .observed
            .as_ref()
            .is_none_or(|o| o.holder != holder || o.renew != spec.renew_time);
        if changed {
            self.observed = Some(Observed {
                holder: holder.clone(),
                renew: spec.renew_time.clone(),
                at: Instant::now(),
            });
        }
        let ours = holder.as_deref() == Some(self.cfg.identity.as_str());
        let their_duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(duration_s).max(1) as u64);
        let expired = holder.is_none() || self.observed.as_ref().is_some_and(|o| o.at.elapsed() >= their_duration);
        if !ours && !expired {
            return Ok(false);
        }
        if !ours {
            spec.acquire_time = Some(now());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            spec.holder_identity = Some(self.cfg.identity.clone());
        }
        spec.renew_time = Some(now());
        spec.lease_duration_seconds = Some(duration_s);
        // `replace` sends our resourceVersion: a concurrent writer makes this a 409.
        let r = self.api.replace(&self.cfg.name, &PostParams::default(), &lease).await;
        conflict_is_false(r)
    }

    /// Gives the lease up (on shutdown) so a follower takes over at once.
    async fn release(&mut self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.cfg.name).await
            && let Some(spec) = lease.spec.as_mut()
            && spec.holder_identity.as_deref() == Some(self.cfg.identity.as_str())
        {
            spec.holder_identity = None;
            spec.renew_time = Some(now());
            if let Err(e) = self.api.replace(&self.cfg.name, &PostParams::default(), &lease).await {
                warn!(error = %e, "releasing the lease");
            }
        }
    }
}

fn conflict_is_false(r: Result<Lease, kube::Error>) -> Result<bool, kube::Error> {
    match r {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Runs the election until `shutdown`, publishing whether we lead on `leading`.
pub async fn run(
    client: Client,
    cfg: LeaseConfig,
    leading: watch::Sender<bool>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut e = Elector {
        api: Api::namespaced(client, &cfg.namespace),
        cfg: cfg.clone(),
        observed: None,
    };
    let mut last_renew: Option<Instant> = None;
    let mut labelled = label_role(&e.api, &cfg, false).await;
    loop {
        let held = match e.try_acquire_or_renew().await {
            Ok(true) => {
                last_renew = Some(Instant::now());
                true
            }
            Ok(false) => false,
            Err(err) => {
                warn!(error = %err, "lease request failed");
                // Keep leading only while the last renewal is fresh enough.
                last_renew.is_some_and(|t| t.elapsed() < cfg.renew_deadline)
            }
        };
        if !held {
            last_renew = None;
        }
        if *leading.borrow() != held || (held && !labelled) {
            if *leading.borrow() != held {
                info!(identity = cfg.identity, leading = held, "leadership changed");
                leading.send_replace(held);
            }
            labelled = label_role(&e.api, &cfg, held).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.retry_period) => {}
            _ = &mut shutdown => break,
        }
    }
    if *leading.borrow() {
        leading.send_replace(false);
        label_role(&e.api, &cfg, false).await;
        e.release().await;
    }
}

/// Sets the role label on our own pod; true when done (or not wanted).
async fn label_role(leases: &Api<Lease>, cfg: &LeaseConfig, leader: bool) -> bool {
    if !cfg.label_pod {
        return true;
    }
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(leases.clone().into_client(), &cfg.namespace);
    let role = if leader { "leader" } else { "follower" };
    let patch = serde_json::json!({"metadata": {"labels": {tessera_core::names::LABEL_EXTENDER_ROLE: role}}});
    match pods
        .patch(
            &cfg.identity,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => true,
        Err(err) => {
            warn!(pod = cfg.identity, role, error = %err, "cannot label our pod with its role");
            false
        }
    }
}
