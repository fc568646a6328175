//! The webhook's serving certificate, kept by the extender itself: a CA and a certificate for the
//! webhook Service's DNS names, stored in a `kubernetes.io/tls` Secret (with `ca.crt`) that every
//! replica shares, and the CA written into the MutatingWebhookConfiguration's `caBundle`, again
//! whenever the configuration is applied without it. Deleting the Secret and restarting the
//! extender rotates both.

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
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
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

/// The DNS names of `service` in `namespace`.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// A new CA and a certificate it signed for `names`.
pub fn generate(names: Vec<String>) -> anyhow::Result<ServingCert> {
    let mut ca_params = CertificateParams::default();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tessera-webhook-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let mut params = CertificateParams::new(names.clone())?;
    params
        .distinguished_name
        .push(DnType::CommonName, names.first().cloned().unwrap_or_default());
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca)?;
    Ok(ServingCert {
        cert: cert.pem().into_bytes(),
        key: key.serialize_pem().into_bytes(),
        ca: ca.as_ref().pem().into_bytes(),
    })
}

fn from_secret(s: &Secret) -> Option<ServingCert> {
    let d = s.data.as_ref()?;
    let get = |k: &str| d.get(k).map(|b| b.0.clone()).filter(|b| !b.is_empty());
    Some(ServingCert {
        cert: get("tls.crt")?,
        key: get("tls.key")?,
        ca: get("ca.crt")?,
    })
}

/// The certificate in the Secret, creating both when there is none. Replicas starting together
/// all end up with whichever was created first.
pub async fn ensure_secret(client: &Client, cfg: &SelfManaged) -> anyhow::Result<ServingCert> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let what = || format!("Secret {}/{}", cfg.namespace, cfg.secret);
    if let Some(s) = api.get_opt(&cfg.secret).await.with_context(what)? {
        return from_secret(&s).with_context(|| format!("{} lacks tls.crt, tls.key or ca.crt", what()));
    }
    let fresh = generate(service_names(&cfg.service, &cfg.namespace))?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(cfg.secret.clone()),
            namespace: Some(cfg.namespace.clone()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_string(),
                "tessera".to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            ("tls.crt".to_string(), ByteString(fresh.cert.clone())),
            ("tls.key".to_string(), ByteString(fresh.key.clone())),
            ("ca.crt".to_string(), ByteString(fresh.ca.clone())),
        ])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            info!(secret = what(), "created the webhook's certificate");
            Ok(fresh)
        }
        // Another replica won: use its certificate.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let s = api.get(&cfg.secret).await.with_context(what)?;
            from_secret(&s).with_context(|| format!("{} lacks tls.crt, tls.key or ca.crt", what()))
        }
        Err(e) => Err(e).with_context(|| format!("creating {}", what())),
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

/// Keeps the configuration's `caBundle` at `ca`: written now, and again whenever the
/// configuration is created or applied without it, until the task is dropped.
pub async fn keep_ca_bundle(client: Client, name: String, ca: Vec<u8>) {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let events = watcher::watcher(api, watcher::Config::default().fields(&format!("metadata.name={name}")))
        .default_backoff()
        .applied_objects();
    let mut events = std::pin::pin!(events);
    while let Some(ev) = events.next().await {
        match ev {
            Ok(cfg) if cfg.metadata.name.as_deref() == Some(name.as_str()) => {
                let current = cfg
                    .webhooks
                    .iter()
                    .flatten()
                    .all(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) == Some(ca.as_slice()));
                if current {
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
            Ok(_) => {}
            Err(e) => warn!(configuration = name, error = %e, "watching the webhook configuration"),
        }
    }
}
