//! HTTPS: rustls (ring) with a PEM certificate chain and key, serving the same router; with a
//! client CA, a client's certificate is verified against it during the handshake and each
//! request says whether its connection presented one ([`ClientCert`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tracing::debug;

/// Whether the request's connection presented a client certificate that the client CA signed
/// (a certificate it did not sign fails the handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCert(pub bool);

/// A TLS acceptor for the certificate chain and key in `cert` and `key` (PEM), verifying
/// client certificates against `client_ca` when given.
pub fn acceptor(cert: &Path, key: &Path, client_ca: Option<&Path>) -> anyhow::Result<TlsAcceptor> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let ca = client_ca.map(read).transpose()?;
    acceptor_from_pem(&read(cert)?, &read(key)?, ca.as_deref())
        .with_context(|| format!("{} and {}", cert.display(), key.display()))
}

/// A TLS acceptor for a certificate chain and key held in memory (PEM), verifying client
/// certificates against `client_ca` (PEM) when given. Clients without a certificate are let
/// through the handshake (probes, scrapes); what they may call is the router's to decide.
pub fn acceptor_from_pem(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> anyhow::Result<TlsAcceptor> {
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .context("parsing the certificate chain")?;
    anyhow::ensure!(!certs.is_empty(), "the certificate PEM holds no certificate");
    let key = PrivateKeyDer::from_pem_slice(key).context("parsing the private key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        rustls::ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(ca) {
                roots.add(c.context("parsing the client CA")?)?;
            }
            anyhow::ensure!(!roots.is_empty(), "the client CA PEM holds no certificate");
            builder.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .allow_unauthenticated()
                    .build()?,
            )
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .context("certificate and key do not match")?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// What one listener takes: a connection gets `handshake` to finish TLS and `header_read` to
/// send a request's headers, counted from when the server starts reading (a client that sends
/// nothing, or trickles them, is dropped), and at most `connections` are served at once (the
/// next waits to be accepted).
#[derive(Debug, Clone, Copy)]
pub struct ListenerLimits {
    /// Time for the TLS handshake.
    pub handshake: Duration,
    /// Time for a request's headers.
    pub header_read: Duration,
    /// Connections served at once.
    pub connections: usize,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            handshake: Duration::from_secs(10),
            header_read: Duration::from_secs(10),
            connections: 64,
        }
    }
}

/// Serves `app` until `stop` resolves: over TLS with `acceptor` (each connection with the one
/// it holds when the connection comes: a certificate can change while serving), else plain
/// HTTP, within `limits`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    acceptor: Option<tokio::sync::watch::Receiver<TlsAcceptor>>,
    app: Router,
    limits: ListenerLimits,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections.max(1)));
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            _ = &mut stop => return,
        };
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    debug!(error = %e, "accept");
                    continue;
                }
            },
            _ = &mut stop => return,
        };
        let acceptor = acceptor.as_ref().map(|a| a.borrow().clone());
        let app = app.clone();
        tokio::spawn(async move {
            let _slot = slot;
            // HTTP/1.1 only (what kube-scheduler and the API server speak here, no ALPN): the
            // header timer then runs from the connection's first read. With HTTP/2 allowed, the
            // builder first waited for bytes to tell the versions apart, with no timer, and 64
            // clients that sent nothing held every slot.
            let mut http = auto::Builder::new(TokioExecutor::new()).http1_only();
            http.http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read);
            let served = match acceptor {
                None => {
                    let svc = TowerToHyperService::new(app.layer(axum::Extension(ClientCert(false))));
                    http.serve_connection(TokioIo::new(tcp), svc).await
                }
                Some(acceptor) => {
                    let tls = match tokio::time::timeout(limits.handshake, acceptor.accept(tcp)).await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            debug!(%peer, error = %e, "TLS handshake");
                            return;
                        }
                        Err(_) => {
                            debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let presented = tls.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty());
                    let svc = TowerToHyperService::new(app.layer(axum::Extension(ClientCert(presented))));
                    http.serve_connection(TokioIo::new(tls), svc).await
                }
            };
            if let Err(e) = served {
                debug!(%peer, error = %e, "connection");
            }
        });
    }
}
