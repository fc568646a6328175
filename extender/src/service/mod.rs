//! The kube-scheduler HTTP extender: filter / prioritize / bind / preempt over the core
//! [`Ledger`](tessera_core::ledger::Ledger), fed by watches on Nodes and Pods, with Lease
//! leader election so that several replicas never bind at once.

pub mod bind;
pub mod cluster;
pub mod cpus;
pub mod events;
pub mod http;
pub mod keys;
pub mod leader;
pub mod metrics;
pub mod podview;
pub mod scores;
pub mod tenants;
pub mod tls;
pub mod verb_certs;
pub mod watch;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::runtime::reflector::Store;
use tokio::sync::watch as tokio_watch;
use tokio::task::JoinHandle;

use cluster::Cluster;
use leader::LeaseConfig;
use metrics::Metrics;

/// Everything a request handler needs.
pub struct Service {
    /// The cluster view.
    pub cluster: Arc<Cluster>,
    /// Pods by namespace/name (from the pod watch).
    pub pods: Store<Pod>,
    /// API client (patch, binding).
    pub client: Client,
    leading: tokio_watch::Receiver<bool>,
    /// Metrics.
    pub metrics: Metrics,
    /// Events on pods (bound, bind failed).
    pub events: events::Recorder,
    /// The last filters' scores, for the prioritize calls that follow them.
    pub handoff: scores::Handoff,
}

impl Service {
    /// True while this replica holds the lease (or runs without election).
    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    /// A receiver of leadership changes.
    pub fn leadership(&self) -> tokio_watch::Receiver<bool> {
        self.leading.clone()
    }
}

/// How to run the service.
pub struct ServiceConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// URL prefix of the verbs.
    pub prefix: String,
    /// Largest request body accepted, bytes.
    pub body_limit: usize,
    /// Lease election; `None` runs as the only (always leading) replica.
    pub lease: Option<LeaseConfig>,
    /// Serve the verbs over HTTPS (and, with a client CA, only to the scheduler); `None`
    /// serves plain HTTP to anyone who reaches the port.
    pub tls: Option<VerbTls>,
    /// Serve ElasticGPU claims: watch Tessera's custom resources, book retained GPUs and run
    /// the claims controller (the CRDs must be installed).
    pub claims: bool,
    /// Serve the claims' admission webhook (needs `claims`).
    pub webhook: Option<WebhookConfig>,
    /// What each listener (the verbs', the webhook's) takes.
    pub limits: tls::ListenerLimits,
}

/// The verbs' certificates.
#[derive(Debug, Clone)]
pub enum VerbTls {
    /// A certificate chain and key (PEM files); with `client_ca`, the verbs answer only
    /// clients whose certificate it signed.
    Files {
        /// The certificate chain.
        cert: PathBuf,
        /// Its key.
        key: PathBuf,
        /// The CA of the clients the verbs answer.
        client_ca: Option<PathBuf>,
    },
    /// Kept by the extender in a Secret it creates when absent (see [`verb_certs`]): its
    /// serving certificate for the Service's DNS names and the scheduler's client
    /// certificate, signed by one CA; the verbs answer only that client.
    SelfManaged(verb_certs::VerbCerts),
}

/// Where and with which certificate the admission webhook is served.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Listen address (HTTPS).
    pub listen: SocketAddr,
    /// Its certificate.
    pub tls: WebhookTls,
}

/// The webhook's certificate.
#[derive(Debug, Clone)]
pub enum WebhookTls {
    /// PEM files (a mounted Secret kept by cert-manager or the like).
    Files(PathBuf, PathBuf),
    /// Kept by the extender in a Secret, with the webhook configuration's `caBundle`.
    SelfManaged(tessera_claims::admission::certs::SelfManaged),
}

/// A running service: its address and background tasks (dropped = stopped).
pub struct Running {
    /// The bound address.
    pub addr: SocketAddr,
    /// The admission webhook's bound address, when it is served.
    pub webhook_addr: Option<SocketAddr>,
    /// The shared state.
    pub service: Arc<Service>,
    tasks: Vec<JoinHandle<()>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    election: Option<JoinHandle<()>>,
}

impl Running {
    /// Stops serving; a leader gives up its lease so a follower takes over at once.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(e) = self.election.take() {
            let _ = e.await;
        }
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }

    /// Stops at once, as a killed process would: no lease release.
    pub fn kill(mut self) {
        for t in self.tasks.drain(..).chain(self.election.take()) {
            t.abort();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for t in self.tasks.drain(..).chain(self.election.take()) {
            t.abort();
        }
    }
}

/// Selects rustls' ring provider for the process. Two providers are linked (ring for kube,
/// aws-lc-rs through the CDI crate's schema validator), so rustls cannot pick one by itself.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Starts watches, election and the HTTP server.
pub async fn start(client: Client, cluster: Arc<Cluster>, cfg: ServiceConfig) -> anyhow::Result<Running> {
    install_crypto_provider();
    cpus::keep_helpers_off_the_caller();
    anyhow::ensure!(
        cfg.claims || cfg.webhook.is_none(),
        "the admission webhook serves ElasticGPU claims: it needs them turned on"
    );
    let (store, writer) = watch::pod_store();
    let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
    // Namespaces' tenants first: a pod, and a claim's retained share, is booked under its
    // tenant.
    cluster.tenants().track();
    let claims = cfg.claims.then(|| {
        // The ElasticGPUs book retained GPUs in the ledger: the service follows them and lends
        // their store to the claims.
        let (elastic_gpus, writer) = kube::runtime::reflector::store();
        let (stores, mut tasks) = tessera_claims::watch(&client, elastic_gpus, trigger.clone());
        tasks.push(tokio::spawn(watch::elastic_gpus(
            client.clone(),
            cluster.clone(),
            writer,
            trigger.clone(),
        )));
        (stores, tasks)
    });
    let pods = watch::pods(
        client.clone(),
        cluster.clone(),
        writer,
        cfg.claims.then(|| trigger.clone()),
    );
    let tenants = cluster.tenants().clone();
    let mut tasks = vec![
        tokio::spawn(tenants::watch(client.clone(), tenants.clone())),
        tokio::spawn(watch::nodes(client.clone(), cluster.clone())),
        tokio::spawn(async move {
            tenants.wait_synced().await;
            pods.await
        }),
    ];
    let (leading_tx, leading_rx) = tokio_watch::channel(cfg.lease.is_none());
    let mut webhook_server = None;
    if let Some((stores, watches)) = claims {
        tasks.extend(watches);
        let reconciler = tessera_claims::controller::Reconciler {
            client: client.clone(),
            cluster: cluster.clone(),
            pods: store.clone(),
            stores: stores.clone(),
        };
        tasks.push(tokio::spawn(reconciler.run(triggered, trigger, leading_rx.clone())));
        if let Some(w) = &cfg.webhook {
            let acceptor = webhook_acceptor(&client, &w.tls, &mut tasks).await?;
            let webhook = Arc::new(tessera_claims::admission::Webhook {
                client: client.clone(),
                stores,
                pods: store.clone(),
                cluster: cluster.clone(),
                opts: cluster.request_options(),
            });
            let listener = tokio::net::TcpListener::bind(w.listen).await?;
            webhook_server = Some((
                listener.local_addr()?,
                listener,
                acceptor,
                tessera_claims::admission::router(webhook),
            ));
        }
    }
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stop_rx = futures_util::FutureExt::shared(async move {
        let _ = stop_rx.await;
    });
    let election = cfg.lease.map(|lease| {
        let stop = stop_rx.clone();
        tokio::spawn(leader::run(client.clone(), lease, leading_tx, stop))
    });
    let service = Arc::new(Service {
        cluster,
        pods: store,
        client,
        leading: leading_rx,
        metrics: Metrics::default(),
        events: events::Recorder::default(),
        handoff: scores::Handoff::default(),
    });
    let acceptor = verb_acceptor(&service.client, cfg.tls.as_ref(), &mut tasks).await?;
    let verified_only = acceptor.as_ref().is_some_and(|(_, v)| *v);
    let app = http::router(service.clone(), &cfg.prefix, cfg.body_limit, verified_only);
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    if acceptor.is_none() {
        tracing::warn!("serving the verbs over plain HTTP to anyone who reaches the port");
    }
    let server = tokio::spawn(tls::serve(
        listener,
        acceptor.map(|(a, _)| a),
        app,
        cfg.limits,
        stop_rx.clone(),
    ));
    tasks.push(server);
    let webhook_addr = webhook_server.map(|(addr, listener, acceptor, router)| {
        tasks.push(tokio::spawn(tls::serve(
            listener,
            Some(acceptor),
            router,
            cfg.limits,
            stop_rx.clone(),
        )));
        addr
    });
    Ok(Running {
        addr,
        webhook_addr,
        service,
        tasks,
        stop: Some(stop_tx),
        election,
    })
}

/// The webhook's TLS acceptors: from files, or from the Secret every replica follows (its
/// followers pushed to `tasks`).
async fn webhook_acceptor(
    client: &Client,
    tls_cfg: &WebhookTls,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<tokio_watch::Receiver<tokio_rustls::TlsAcceptor>> {
    Ok(match tls_cfg {
        WebhookTls::Files(cert, key) => {
            let read = |p: &PathBuf| std::fs::read(p).map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()));
            tokio_watch::channel(tls::acceptor_from_pem(&read(cert)?, &read(key)?, None)?).1
        }
        WebhookTls::SelfManaged(sm) => {
            // The Secret is the source of truth: every replica follows it, serves what
            // it holds now and keeps that CA in the configuration.
            use tessera_claims::admission::certs;
            let c = certs::ensure_secret(client, sm).await?;
            let first = tls::acceptor_from_pem(&c.cert, &c.key, None)?;
            let (cert_tx, cert_rx) = tokio_watch::channel(c);
            tasks.push(tokio::spawn(certs::follow_secret(client.clone(), sm.clone(), cert_tx)));
            tasks.push(tokio::spawn(certs::keep_ca_bundle(
                client.clone(),
                sm.webhook_configuration.clone(),
                cert_rx.clone(),
            )));
            let (acceptor_rx, task) = acceptors_of(first, cert_rx, false);
            tasks.push(task);
            acceptor_rx
        }
    })
}

/// The verbs' TLS acceptors and whether clients are verified; none for plain HTTP.
async fn verb_acceptor(
    client: &Client,
    tls_cfg: Option<&VerbTls>,
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<Option<(tokio_watch::Receiver<tokio_rustls::TlsAcceptor>, bool)>> {
    Ok(match tls_cfg {
        None => None,
        Some(VerbTls::Files { cert, key, client_ca }) => Some((
            tokio_watch::channel(tls::acceptor(cert, key, client_ca.as_deref())?).1,
            client_ca.is_some(),
        )),
        Some(VerbTls::SelfManaged(v)) => {
            // Followed like the webhook's: a new pair is served from the next handshake on.
            let c = verb_certs::ensure(client, v).await?;
            let first = tls::acceptor_from_pem(&c.cert, &c.key, Some(&c.ca))?;
            let (cert_tx, cert_rx) = tokio_watch::channel(c);
            tasks.push(tokio::spawn(verb_certs::follow(client.clone(), v.clone(), cert_tx)));
            let (acceptor_rx, task) = acceptors_of(first, cert_rx, true);
            tasks.push(task);
            Some((acceptor_rx, true))
        }
    })
}

/// The TLS acceptors of a followed certificate: `first`, then one for each certificate `certs`
/// gets (that verifies clients against its CA when `verify_clients`); a certificate that
/// cannot be used is logged and the last one kept.
fn acceptors_of(
    first: tokio_rustls::TlsAcceptor,
    mut certs: tokio_watch::Receiver<tessera_claims::admission::certs::ServingCert>,
    verify_clients: bool,
) -> (
    tokio_watch::Receiver<tokio_rustls::TlsAcceptor>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio_watch::channel(first);
    let task = tokio::spawn(async move {
        while certs.changed().await.is_ok() {
            let c = certs.borrow_and_update().clone();
            match tls::acceptor_from_pem(&c.cert, &c.key, verify_clients.then_some(c.ca.as_slice())) {
                Ok(a) => {
                    if tx.send(a).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a followed Secret's certificate is unusable; serving the last one")
                }
            }
        }
    });
    (rx, task)
}
