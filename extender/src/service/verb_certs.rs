//! The verbs' certificates, kept by the extender: one CA signs the extender's serving
//! certificate (the Service's DNS names) and the scheduler's client certificate, and its key is
//! dropped. They are kept in two Secrets, each holding one side's key: the extender's
//! (`tls.crt`, `tls.key` and `ca.crt`, the CA its clients must show) and the scheduler's (its
//! client certificate and key, and the CA it verifies the extender with). The extender may read
//! only its own; it writes the scheduler's, never reads it.
//!
//! The first replica to create the extender's Secret makes the pair: it creates its Secret
//! marked `pending`, writes the scheduler's, then marks its own `written`. Every replica serves
//! only a `written` Secret, follows it ([`follow`]), and makes a new pair when it is deleted;
//! one left `pending` (its maker died between the two writes) is made again after
//! [`VerbCerts::pending_grace`]. So deleting the extender's Secret rotates both, with no extender restart
//! (the scheduler reads its CA file once: it is restarted to trust the new one).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client};
use tessera_claims::admission::certs::{ServingCert, complete, generate_with_clients, service_names, tls_secret};
use tracing::{info, warn};

/// The scheduler's client certificate's common name.
pub const SCHEDULER_CN: &str = "tessera-scheduler";
/// On the extender's Secret: `pending` while the scheduler's is being written, then `written`.
pub const STATE_ANNOTATION: &str = "tessera.io/scheduler-credentials";
/// How long a `pending` Secret is waited for, by default, before it is made again.
pub const PENDING_GRACE: Duration = Duration::from_secs(30);

/// Where the certificates live.
#[derive(Debug, Clone)]
pub struct VerbCerts {
    /// The Secrets' namespace (the extender's).
    pub namespace: String,
    /// The extender's Secret.
    pub secret: String,
    /// The scheduler's Secret (written, never read, by the extender).
    pub scheduler_secret: String,
    /// The extender's Service (the serving certificate is for its DNS names).
    pub service: String,
    /// How long a `pending` Secret is waited for before it is made again ([`PENDING_GRACE`]).
    pub pending_grace: Duration,
}

/// The extender's certificate, key and client CA, when its Secret holds them and the
/// scheduler's Secret was written to match.
pub fn usable(s: &Secret) -> Option<ServingCert> {
    let state = s.metadata.annotations.as_ref()?.get(STATE_ANNOTATION)?;
    if state != "written" {
        return None;
    }
    complete(s)
}

fn secret(namespace: &str, name: &str, cert: ServingCert, state: Option<&str>) -> Secret {
    let mut s = tls_secret(namespace, name, cert.into_files());
    s.metadata.annotations = state.map(|s| BTreeMap::from([(STATE_ANNOTATION.to_string(), s.to_string())]));
    s
}

/// The extender's serving certificate, key and client CA, making a new pair (and both
/// Secrets) when there is none, or only a stale or half-made one.
pub async fn ensure(client: &Client, v: &VerbCerts) -> anyhow::Result<ServingCert> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &v.namespace);
    let what = || format!("Secret {}/{}", v.namespace, v.secret);
    // A pending Secret, by resource version, and since when this replica has seen it so.
    let mut pending: Option<(String, Instant)> = None;
    let deadline = Instant::now() + v.pending_grace * 3;
    while Instant::now() < deadline {
        if let Some(s) = api.get_opt(&v.secret).await.with_context(what)? {
            if let Some(c) = usable(&s) {
                return Ok(c);
            }
            let version = s.metadata.resource_version.clone().unwrap_or_default();
            let marked = s.metadata.annotations.as_ref().and_then(|a| a.get(STATE_ANNOTATION));
            let waiting = match &pending {
                Some((seen, since)) if *seen == version => since.elapsed() < v.pending_grace,
                _ => {
                    pending = Some((version.clone(), Instant::now()));
                    true
                }
            };
            if marked.is_some_and(|m| m == "pending") && waiting {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            // Half-made and abandoned, or of an older layout (one Secret with both keys), or
            // incomplete: made again. Only the version read is deleted.
            warn!(secret = what(), state = ?marked, "replacing the verbs' certificates");
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: Some(version),
                    uid: s.metadata.uid.clone(),
                }),
                ..Default::default()
            };
            match api.delete(&v.secret, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => return Err(e).with_context(|| format!("deleting {}", what())),
            }
            continue;
        }
        let (serving, clients) = generate_with_clients(service_names(&v.service, &v.namespace), &[SCHEDULER_CN])?;
        let scheduler = clients.into_iter().next().expect("one client asked for");
        let created = match api
            .create(
                &PostParams::default(),
                &secret(&v.namespace, &v.secret, serving.clone(), Some("pending")),
            )
            .await
        {
            Ok(created) => created,
            // Another replica makes the pair.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", what())),
        };
        // Only the Secret this replica created, as it created it: a replica that stalled past
        // the grace period (its pending Secret replaced by another's pair) must neither mark
        // nor delete the other's.
        let mine = Preconditions {
            resource_version: created.metadata.resource_version.clone(),
            uid: created.metadata.uid.clone(),
        };
        let delete_mine = DeleteParams {
            preconditions: Some(mine.clone()),
            ..Default::default()
        };
        if let Err(e) = write_scheduler_secret(&api, v, scheduler).await {
            // Let the next try make a whole pair.
            let _ = api.delete(&v.secret, &delete_mine).await;
            return Err(e);
        }
        // The resource version in a merge patch is a precondition: the patch applies only to
        // the Secret as created.
        let written = serde_json::json!({"metadata": {
            "annotations": {STATE_ANNOTATION: "written"},
            "resourceVersion": mine.resource_version,
            "uid": mine.uid,
        }});
        match api
            .patch(&v.secret, &PatchParams::default(), &Patch::Merge(&written))
            .await
        {
            Ok(_) => {}
            // Replaced meanwhile: the scheduler's Secret may now hold this replica's stale
            // client certificate, so the whole pair is made again.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {
                warn!(
                    secret = what(),
                    "replaced while this replica made its pair: making the pair again"
                );
                if let Some(now) = api.get_opt(&v.secret).await.with_context(what)? {
                    let dp = DeleteParams {
                        preconditions: Some(Preconditions {
                            resource_version: now.metadata.resource_version,
                            uid: now.metadata.uid,
                        }),
                        ..Default::default()
                    };
                    let _ = api.delete(&v.secret, &dp).await;
                }
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("marking {} written", what())),
        }
        info!(
            secret = what(),
            scheduler = v.scheduler_secret,
            "made the verbs' certificates"
        );
        return Ok(serving);
    }
    anyhow::bail!("{} stayed half-made for {:?}", what(), v.pending_grace * 3)
}

/// Creates the scheduler's Secret, or replaces one there (not read: its key is not the
/// extender's to see).
async fn write_scheduler_secret(api: &Api<Secret>, v: &VerbCerts, cert: ServingCert) -> anyhow::Result<()> {
    let what = || format!("Secret {}/{}", v.namespace, v.scheduler_secret);
    let s = secret(&v.namespace, &v.scheduler_secret, cert, None);
    match api.create(&PostParams::default(), &s).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => api
            .replace(&v.scheduler_secret, &PostParams::default(), &s)
            .await
            .map(|_| ())
            .with_context(|| format!("replacing {}", what())),
        Err(e) => Err(e).with_context(|| format!("creating {}", what())),
    }
}

/// Follows the extender's Secret: `current` gets what it holds whenever that changes; a new
/// pair is made when it goes. Runs until `current` has no receiver.
pub async fn follow(client: Client, v: VerbCerts, current: tokio::sync::watch::Sender<ServingCert>) {
    let (namespace, name) = (v.namespace.clone(), v.secret.clone());
    let remake = {
        let client = client.clone();
        move || {
            let (client, v) = (client.clone(), v.clone());
            async move { ensure(&client, &v).await }
        }
    };
    tessera_claims::admission::certs::follow(client, &namespace, &name, usable, remake, current).await
}
