//! The verbs' certificates, kept by the extender: one CA signs the extender's serving
//! certificate (the Service's DNS names) and the scheduler's client certificate, and its key is
//! dropped. All are stored in one Secret, created by whichever replica starts first: every
//! replica serves the same certificate and trusts the same client, and the scheduler mounts
//! only its own files (`ca.crt`, `scheduler.crt`, `scheduler.key`). Deleting the Secret and
//! restarting the extender and the scheduler rotates them.

use kube::Client;
use tessera_claims::admission::certs::{ServingCert, ensure_secret_files, generate_with_clients, service_names};

/// The Secret's files: the CA, the extender's certificate and key, the scheduler's.
pub const FILES: [&str; 5] = ["ca.crt", "tls.crt", "tls.key", SCHEDULER_CERT, SCHEDULER_KEY];
/// The scheduler's client certificate in the Secret.
pub const SCHEDULER_CERT: &str = "scheduler.crt";
/// Its key.
pub const SCHEDULER_KEY: &str = "scheduler.key";
/// The client certificate's common name.
pub const SCHEDULER_CN: &str = "tessera-scheduler";

/// Where the certificates live.
#[derive(Debug, Clone)]
pub struct VerbCerts {
    /// The Secret's namespace (the extender's).
    pub namespace: String,
    /// The Secret.
    pub secret: String,
    /// The extender's Service (the serving certificate is for its DNS names).
    pub service: String,
}

/// The extender's serving certificate, key and the CA (which signed the scheduler's client
/// certificate too), creating the Secret when there is none.
pub async fn ensure(client: &Client, v: &VerbCerts) -> anyhow::Result<ServingCert> {
    let mut files = ensure_secret_files(client, &v.namespace, &v.secret, &FILES, || {
        let (serving, clients) = generate_with_clients(service_names(&v.service, &v.namespace), &[SCHEDULER_CN])?;
        let scheduler = clients.into_iter().next().expect("one client asked for");
        let mut files = serving.into_files();
        files.insert(SCHEDULER_CERT.to_string(), scheduler.cert);
        files.insert(SCHEDULER_KEY.to_string(), scheduler.key);
        Ok(files)
    })
    .await?;
    Ok(ServingCert::from_files(&mut files))
}
