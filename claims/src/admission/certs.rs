//! The webhook's serving certificate, kept by the extender itself: a CA and a certificate for the
//! webhook Service's DNS names, stored in a `kubernetes.io/tls` Secret (with `ca.crt`) that every
//! replica shares, and the CA written into the MutatingWebhookConfiguration's `caBundle`, again
//! whenever the configuration is applied without it. The Secret is the source of truth: every
//! replica follows it ([`follow_secret`]) and serves, and keeps in the `caBundle`, what it holds
//! now; deleting it rotates both, with no restart and no replica writing another CA.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use tracing::{info, warn};

/// Where the certificate lives and what it is for.
#[derive(Debug, Clone)]
pub struct SelfManaged {
    /// The namespace of the Secret and the Service.
    pub namespace: String,
    /// The Secret's name.
    pub secret: String,
    /// The webhook Service's name (the certificate is for its DNS names).
    pub service: String,
    /// The MutatingWebhookConfiguration whose `caBundle` is kept.
    pub webhook_configuration: String,
}

/// A serving certificate and key, and the CA that signed it (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingCert {
    /// `tls.crt`.
    pub cert: Vec<u8>,
    /// `tls.key`.
    pub key: Vec<u8>,
    /// `ca.crt`.
    pub ca: Vec<u8>,
}

impl ServingCert {
    /// As a `kubernetes.io/tls` Secret's files: `tls.crt`, `tls.key`, `ca.crt`.
    pub fn into_files(self) -> BTreeMap<String, Vec<u8>> {
        BTreeMap::from([
            ("tls.crt".to_string(), self.cert),
            ("tls.key".to_string(), self.key),
            ("ca.crt".to_string(), self.ca),
        ])
    }

    /// Taken out of a Secret's files (those [`ServingCert::into_files`] names).
    pub fn from_files(files: &mut BTreeMap<String, Vec<u8>>) -> Self {
        let mut take = |k: &str| files.remove(k).unwrap_or_default();
        Self {
            cert: take("tls.crt"),
            key: take("tls.key"),
            ca: take("ca.crt"),
        }
    }
}

/// The DNS names of `service` in `namespace`.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// A new CA (its key dropped once it has signed) and a serving certificate it signed for
/// `names`.
pub fn generate(names: Vec<String>) -> anyhow::Result<ServingCert> {
    Ok(generate_with_clients(names, &[])?.0)
}

/// A new CA, a serving certificate it signed for `names`, and a client certificate it signed
/// for each of `clients` (common names). The CA's key is dropped: nothing more can be signed.
pub fn generate_with_clients(names: Vec<String>, clients: &[&str]) -> anyhow::Result<(ServingCert, Vec<ServingCert>)> {
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name.push(DnType::CommonName, "tessera-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let ca_pem = ca.as_ref().pem().into_bytes();
    let sign = |params: CertificateParams| -> anyhow::Result<ServingCert> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &ca)?;
        Ok(ServingCert {
            cert: cert.pem().into_bytes(),
            key: key.serialize_pem().into_bytes(),
            ca: ca_pem.clone(),
        })
    };
    let mut params = CertificateParams::new(names.clone())?;
    params
        .distinguished_name
        .push(DnType::CommonName, names.first().cloned().unwrap_or_default());
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving = sign(params)?;
    let clients = clients
        .iter()
        .map(|cn| {
            let mut params = CertificateParams::default();
            params.distinguished_name.push(DnType::CommonName, *cn);
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            sign(params)
        })
        .collect::<anyhow::Result<_>>()?;
    Ok((serving, clients))
}

/// A `kubernetes.io/tls` Secret of Tessera's (labelled part of it) holding `files`.
pub fn tls_secret(namespace: &str, name: &str, files: BTreeMap<String, Vec<u8>>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_string(),
                "tessera".to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(files.into_iter().map(|(k, v)| (k, ByteString(v))).collect()),
        ..Default::default()
    }
}

/// The PEM files of a Secret the extender keeps, read when it exists with every key of
/// `keys`; else `make`s them and creates the Secret. Replicas starting together all end up with
/// whichever was created first (no replica overwrites another's).
pub async fn ensure_secret_files(
    client: &Client,
    namespace: &str,
    name: &str,
    keys: &[&str],
    make: impl FnOnce() -> anyhow::Result<BTreeMap<String, Vec<u8>>>,
) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let what = || format!("Secret {namespace}/{name}");
    let files = |s: &Secret| -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
        let d = s.data.clone().unwrap_or_default();
        keys.iter()
            .map(|k| {
                d.get(*k)
                    .map(|b| (k.to_string(), b.0.clone()))
                    .filter(|(_, b)| !b.is_empty())
                    .with_context(|| format!("{} lacks {k}", what()))
            })
            .collect()
    };
    if let Some(s) = api.get_opt(name).await.with_context(what)? {
        return files(&s);
    }
    let fresh = make()?;
    let secret = tls_secret(namespace, name, fresh.clone());
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            info!(secret = what(), "created the certificates");
            Ok(fresh)
        }
        // Another replica won: use its files.
        Err(kube::Error::Api(e)) if e.code == 409 => files(&api.get(name).await.with_context(what)?),
        Err(e) => Err(e).with_context(|| format!("creating {}", what())),
    }
}

/// The webhook's certificate in its Secret, creating both when there is none.
pub async fn ensure_secret(client: &Client, cfg: &SelfManaged) -> anyhow::Result<ServingCert> {
    let mut files = ensure_secret_files(
        client,
        &cfg.namespace,
        &cfg.secret,
        &["tls.crt", "tls.key", "ca.crt"],
        || Ok(generate(service_names(&cfg.service, &cfg.namespace))?.into_files()),
    )
    .await?;
    Ok(ServingCert::from_files(&mut files))
}

/// The certificate a Secret holds as `tls.crt`, `tls.key` and `ca.crt`, when it holds all three.
pub fn complete(s: &Secret) -> Option<ServingCert> {
    let d = s.data.as_ref()?;
    let get = |k: &str| d.get(k).map(|b| b.0.clone()).filter(|b| !b.is_empty());
    Some(ServingCert {
        cert: get("tls.crt")?,
        key: get("tls.key")?,
        ca: get("ca.crt")?,
    })
}

/// Follows the webhook's Secret: `current` gets what it holds whenever that changes; when the
/// Secret goes (or is incomplete), a new one is made, and the first replica's wins for all.
/// Runs until `current` has no receiver.
pub async fn follow_secret(client: Client, cfg: SelfManaged, current: tokio::sync::watch::Sender<ServingCert>) {
    let (namespace, name) = (cfg.namespace.clone(), cfg.secret.clone());
    let remake = {
        let client = client.clone();
        move || {
            let (client, cfg) = (client.clone(), cfg.clone());
            async move { ensure_secret(&client, &cfg).await }
        }
    };
    follow(client, &namespace, &name, complete, remake, current).await
}

/// Follows the Secret `namespace/name`: `current` gets what `read` finds in it whenever that
/// changes; when the Secret goes, or `read` finds nothing usable in it, `remake` is awaited
/// for what to use instead (retried every 2 s while it fails). Runs until `current` has no
/// receiver.
pub async fn follow<F>(
    client: Client,
    namespace: &str,
    name: &str,
    read: impl Fn(&Secret) -> Option<ServingCert>,
    remake: impl Fn() -> F,
    current: tokio::sync::watch::Sender<ServingCert>,
) where
    F: std::future::Future<Output = anyhow::Result<ServingCert>>,
{
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let events =
        watcher::watcher(api, watcher::Config::default().fields(&format!("metadata.name={name}"))).default_backoff();
    let mut events = std::pin::pin!(events);
    let mut seen = false;
    loop {
        let gone = tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s))) => {
                    seen = true;
                    match read(&s) {
                        Some(c) => {
                            current.send_if_modified(|old| {
                                let changed = *old != c;
                                if changed {
                                    info!(secret = name, "serving the certificate the Secret holds now");
                                    *old = c;
                                }
                                changed
                            });
                            false
                        }
                        None => true,
                    }
                }
                Some(Ok(watcher::Event::Delete(_))) => true,
                Some(Ok(watcher::Event::Init)) => {
                    seen = false;
                    false
                }
                Some(Ok(watcher::Event::InitDone)) => !seen,
                Some(Err(e)) => {
                    warn!(secret = name, error = %e, "watching the certificate's Secret");
                    false
                }
                None => return,
            },
            _ = current.closed() => return,
        };
        if gone {
            // Made again; another replica may win the creation, and then everyone reads its.
            match remake().await {
                Ok(c) => {
                    current.send_if_modified(|old| {
                        let changed = *old != c;
                        *old = c;
                        changed
                    });
                }
                Err(e) => {
                    warn!(secret = name, error = %e, "cannot make the certificate's Secret; trying again");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        }
    }
}

/// Sets every webhook's `caBundle` in the configuration to `ca`; true when it changed (false
/// too when the configuration does not exist yet).
pub async fn write_ca_bundle(client: &Client, name: &str, ca: &[u8]) -> anyhow::Result<bool> {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    // Replace with the version read; on a conflict, read again.
    for _ in 0..5 {
        let Some(mut cfg) = api
            .get_opt(name)
            .await
            .with_context(|| format!("reading MutatingWebhookConfiguration {name}"))?
        else {
            warn!(configuration = name, "the webhook configuration does not exist (yet)");
            return Ok(false);
        };
        let mut changed = false;
        for w in cfg.webhooks.iter_mut().flatten() {
            if w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(ca) {
                w.client_config.ca_bundle = Some(ByteString(ca.to_vec()));
                changed = true;
            }
        }
        if !changed {
            return Ok(false);
        }
        match api.replace(name, &PostParams::default(), &cfg).await {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e).with_context(|| format!("writing the caBundle of {name}")),
        }
    }
    anyhow::bail!("MutatingWebhookConfiguration {name} kept changing while its caBundle was written")
}

/// Keeps the configuration's `caBundle` at the CA of `cert` as it is now: written at once, when
/// the certificate changes, and whenever the configuration is created or applied without it,
/// until the task is dropped.
pub async fn keep_ca_bundle(client: Client, name: String, mut cert: tokio::sync::watch::Receiver<ServingCert>) {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let events = watcher::watcher(api, watcher::Config::default().fields(&format!("metadata.name={name}")))
        .default_backoff()
        .applied_objects();
    let mut events = std::pin::pin!(events);
    let mut ca = cert.borrow_and_update().ca.clone();
    loop {
        let stale = tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(cfg)) if cfg.metadata.name.as_deref() == Some(name.as_str()) => !cfg
                    .webhooks
                    .iter()
                    .flatten()
                    .all(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) == Some(ca.as_slice())),
                Some(Ok(_)) => false,
                Some(Err(e)) => {
                    warn!(configuration = name, error = %e, "watching the webhook configuration");
                    false
                }
                None => return,
            },
            changed = cert.changed() => match changed {
                Ok(()) => {
                    ca = cert.borrow_and_update().ca.clone();
                    true
                }
                Err(_) => return,
            },
        };
        if !stale {
            continue;
        }
        loop {
            match write_ca_bundle(&client, &name, &ca).await {
                Ok(true) => info!(configuration = name, "wrote the webhook's caBundle"),
                Ok(false) => {}
                Err(e) => {
                    warn!(configuration = name, error = %e, "cannot write the webhook's caBundle; trying again");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    continue;
                }
            }
            break;
        }
    }
}
