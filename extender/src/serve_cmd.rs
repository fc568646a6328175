//! `tessera-extender serve`: the scheduler extender service.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use tessera_claims::admission::certs::SelfManaged;
use tessera_core::flags::{listen_address, memory_unit_mib};
use tessera_core::placement::EngineConfig;
use tessera_core::policy::PolicyKind;
use tessera_core::request::RequestOptions;
use tessera_extender::service::cluster::Cluster;
use tessera_extender::service::leader::LeaseConfig;
use tessera_extender::service::verb_certs::VerbCerts;
use tessera_extender::service::{self, ServiceConfig, VerbTls, WebhookConfig, WebhookTls};
use tracing::info;

#[derive(Args)]
pub struct ServeArgs {
    /// Listen address (`IP:PORT`).
    #[arg(long, default_value = "0.0.0.0:8888", value_parser = listen_address)]
    listen: SocketAddr,
    /// URL prefix of the verbs (the scheduler's `urlPrefix` path).
    #[arg(long, default_value = "/tessera")]
    prefix: String,
    /// Directory of the hand-off signing keys (a mounted Secret: one file per key, `active`).
    #[arg(long, default_value = "/etc/tessera/keys")]
    keys_dir: PathBuf,
    /// Node-tier policy.
    #[arg(long, default_value = "mosaic")]
    node_policy: PolicyKind,
    /// Card-tier policy.
    #[arg(long, default_value = "mosaic")]
    gpu_policy: PolicyKind,
    /// MiB in one unit of `tessera.io/gpu-memory` (must match the device plugin).
    #[arg(long, default_value_t = RequestOptions::default().memory_unit_mib, value_parser = memory_unit_mib)]
    memory_unit_mib: u64,
    /// Largest request body, bytes (a `Nodes` list of a big cluster is large).
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Connections each listener (the verbs', the webhook's) serves at once; more wait. A
    /// connection gets 10 s for its TLS handshake and 10 s for each request's headers.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    max_connections: u64,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// With --tls-cert: answer the verbs only for clients whose certificate this CA (PEM)
    /// signed, i.e. the scheduler (its `extenders[].tlsConfig` certFile and keyFile).
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// Keep the verbs' certificates in this Secret (in the lease namespace), created when
    /// absent: a serving certificate for --tls-service, and the CA of the scheduler's client
    /// certificate, which alone may call the verbs. Followed: deleting it makes a new pair.
    /// Without it or --tls-cert the verbs are plain HTTP.
    #[arg(long, conflicts_with = "tls_cert")]
    tls_secret: Option<String>,
    /// With --tls-secret: write the scheduler's client certificate, key and the CA into this
    /// Secret (never read back: the extender holds no scheduler key).
    #[arg(long, default_value = "tessera-scheduler-tls")]
    scheduler_tls_secret: String,
    /// The extender's Service (the self-kept certificate is for its DNS names).
    #[arg(long, default_value = "tessera-extender")]
    tls_service: String,
    /// Run without leader election (a single replica).
    #[arg(long)]
    no_leader_election: bool,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "tessera-system")]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, default_value = "tessera-extender")]
    lease_name: String,
    /// This replica's identity in the Lease (the pod name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Lease duration, seconds.
    #[arg(long, alias = "lease-duration-s", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    lease_duration_secs: u64,
    /// Do not serve ElasticGPU claims (for clusters without Tessera's CRDs); implies
    /// --no-webhook.
    #[arg(long)]
    no_claims: bool,
    /// Do not serve the claims' admission webhook.
    #[arg(long)]
    no_webhook: bool,
    /// The admission webhook's listen address (HTTPS, `IP:PORT`).
    #[arg(long, default_value = "0.0.0.0:9443", value_parser = listen_address)]
    webhook_listen: SocketAddr,
    /// The webhook's PEM certificate chain (with --webhook-key); without them the extender
    /// keeps its own in --webhook-secret and writes its CA into --webhook-configuration.
    #[arg(long, requires = "webhook_key")]
    webhook_cert: Option<PathBuf>,
    /// The PEM private key for --webhook-cert.
    #[arg(long, requires = "webhook_cert")]
    webhook_key: Option<PathBuf>,
    /// The Secret (in the lease namespace) holding the webhook's own certificate.
    #[arg(long, default_value = "tessera-webhook-tls")]
    webhook_secret: String,
    /// The webhook's Service (the certificate is for its DNS names).
    #[arg(long, default_value = "tessera-extender-webhook")]
    webhook_service: String,
    /// The MutatingWebhookConfiguration whose caBundle the extender keeps.
    #[arg(long, default_value = "tessera-extender")]
    webhook_configuration: String,
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let keys = tessera_extender::service::keys::signing_keys(&args.keys_dir)
        .map_err(|e| anyhow::anyhow!("loading hand-off keys from {}: {e}", args.keys_dir.display()))?;
    service::install_crypto_provider();
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let cluster = Arc::new(
        Cluster::new(
            EngineConfig {
                node_policy: args.node_policy,
                gpu_policy: args.gpu_policy,
                seed: 0,
            },
            keys,
            RequestOptions {
                memory_unit_mib: args.memory_unit_mib,
            },
        )
        .reloading_keys_from(args.keys_dir.clone()),
    );
    let lease = (!args.no_leader_election).then(|| {
        let identity = args.identity.clone().unwrap_or_else(|| {
            let host = nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned());
            format!("{}-{}", host.unwrap_or_else(|_| "tessera".into()), std::process::id())
        });
        let mut l = LeaseConfig::new(&args.lease_namespace, &args.lease_name, &identity);
        // In a pod (POD_NAME given), label it with its role for the Service.
        l.label_pod = args.identity.is_some();
        l.lease_duration = Duration::from_secs(args.lease_duration_secs.max(3));
        l.renew_deadline = l.lease_duration * 2 / 3;
        l.retry_period = l.lease_duration / 7;
        l
    });
    let running = service::start(
        client,
        cluster,
        ServiceConfig {
            listen: args.listen,
            prefix: args.prefix.clone(),
            body_limit: args.max_body_bytes,
            lease,
            tls: match (&args.tls_cert, &args.tls_key, &args.tls_secret) {
                (Some(cert), Some(key), _) => Some(VerbTls::Files {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: args.client_ca.clone(),
                }),
                (_, _, Some(secret)) => Some(VerbTls::SelfManaged(VerbCerts {
                    namespace: args.lease_namespace.clone(),
                    secret: secret.clone(),
                    scheduler_secret: args.scheduler_tls_secret.clone(),
                    pending_grace: tessera_extender::service::verb_certs::PENDING_GRACE,
                    service: args.tls_service.clone(),
                })),
                _ => None,
            },
            claims: !args.no_claims,
            limits: tessera_extender::service::tls::ListenerLimits {
                connections: args.max_connections as usize,
                ..Default::default()
            },
            webhook: (!args.no_claims && !args.no_webhook).then(|| WebhookConfig {
                listen: args.webhook_listen,
                tls: match args.webhook_cert.clone().zip(args.webhook_key.clone()) {
                    Some((cert, key)) => WebhookTls::Files(cert, key),
                    None => WebhookTls::SelfManaged(SelfManaged {
                        namespace: args.lease_namespace.clone(),
                        secret: args.webhook_secret.clone(),
                        service: args.webhook_service.clone(),
                        webhook_configuration: args.webhook_configuration.clone(),
                    }),
                },
            }),
        },
    )
    .await?;
    info!(addr = %running.addr, prefix = args.prefix, tls = args.tls_cert.is_some() || args.tls_secret.is_some(), webhook = ?running.webhook_addr, "serving");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    info!("shutting down");
    running.shutdown().await;
    Ok(())
}
