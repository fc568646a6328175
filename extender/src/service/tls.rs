//! HTTPS: rustls (ring) with a PEM certificate chain and key, serving the same router.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tracing::debug;

/// A TLS acceptor for the certificate chain and key in `cert` and `key` (PEM).
pub fn acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    acceptor_from_pem(&read(cert)?, &read(key)?).with_context(|| format!("{} and {}", cert.display(), key.display()))
}

/// A TLS acceptor for a certificate chain and key held in memory (PEM).
pub fn acceptor_from_pem(cert: &[u8], key: &[u8]) -> anyhow::Result<TlsAcceptor> {
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .context("parsing the certificate chain")?;
    anyhow::ensure!(!certs.is_empty(), "the certificate PEM holds no certificate");
    let key = PrivateKeyDer::from_pem_slice(key).context("parsing the private key")?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not match")?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `app` over TLS until `stop` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    acceptor: TlsAcceptor,
    app: Router,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
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
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    debug!(%peer, error = %e, "TLS handshake");
                    return;
                }
            };
            let svc = TowerToHyperService::new(app);
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), svc)
                .await
            {
                debug!(%peer, error = %e, "connection");
            }
        });
    }
}
