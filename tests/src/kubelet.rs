//! A fake kubelet for device plugin tests: the Registration server on `kubelet.sock`, and the
//! kubelet's side of ListAndWatch / Allocate on the plugin's socket.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tessera_proto::deviceplugin as api;
use tessera_proto::deviceplugin::device_plugin_client::DevicePluginClient;
use tessera_proto::deviceplugin::registration_server::{Registration, RegistrationServer};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

struct Registrar {
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    /// Registrations still to turn away (as a kubelet that is starting up does).
    refuse: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(&self, request: Request<api::RegisterRequest>) -> Result<Response<api::Empty>, Status> {
        let r = request.into_inner();
        if self
            .refuse
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Status::unavailable("the kubelet is starting"));
        }
        // Like the kubelet: only v1beta1 and extended resource names.
        if r.version != "v1beta1" {
            return Err(Status::invalid_argument(format!("unsupported version {}", r.version)));
        }
        if !r.resource_name.contains('/') || r.resource_name.starts_with("kubernetes.io/") {
            return Err(Status::invalid_argument(format!(
                "{} is not an extended resource",
                r.resource_name
            )));
        }
        let _ = self.tx.send(r);
        Ok(Response::new(api::Empty {}))
    }
}

/// The fake kubelet.
pub struct FakeKubelet {
    dir: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    registrations: mpsc::UnboundedReceiver<api::RegisterRequest>,
    tx: mpsc::UnboundedSender<api::RegisterRequest>,
    refuse: Arc<AtomicUsize>,
}

impl FakeKubelet {
    /// Serves `dir/kubelet.sock`.
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        let (tx, registrations) = mpsc::unbounded_channel();
        let mut k = Self {
            dir: dir.to_path_buf(),
            stop: None,
            registrations,
            tx,
            refuse: Arc::new(AtomicUsize::new(0)),
        };
        k.serve()?;
        Ok(k)
    }

    /// Turns the next `n` registrations away (`UNAVAILABLE`), as a kubelet does in the moment
    /// between creating `kubelet.sock` and serving on it.
    pub fn refuse_next(&self, n: usize) {
        self.refuse.store(n, Ordering::Release);
    }

    fn serve(&mut self) -> anyhow::Result<()> {
        let sock = self.dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let svc = RegistrationServer::new(Registrar {
            tx: self.tx.clone(),
            refuse: self.refuse.clone(),
        });
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await;
        });
        self.stop = Some(stop);
        Ok(())
    }

    /// Restarts like a real kubelet: stops, deletes every non-directory file in the plugin
    /// directory (plugin sockets included), then re-creates `kubelet.sock`.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            if !e.file_type()?.is_dir() {
                std::fs::remove_file(e.path())?;
            }
        }
        self.serve()
    }

    /// The next registration (waits up to 10 s).
    pub async fn next_registration(&mut self) -> anyhow::Result<api::RegisterRequest> {
        tokio::time::timeout(Duration::from_secs(10), self.registrations.recv())
            .await
            .map_err(|_| anyhow::anyhow!("no registration within 10 s"))?
            .ok_or_else(|| anyhow::anyhow!("registration channel closed"))
    }

    /// Registrations until `n` arrived, sorted by resource name.
    pub async fn registrations(&mut self, n: usize) -> anyhow::Result<Vec<api::RegisterRequest>> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(self.next_registration().await?);
        }
        out.sort_by(|a, b| a.resource_name.cmp(&b.resource_name));
        Ok(out)
    }

    /// Whatever else registered within `wait`.
    pub async fn more_registrations(&mut self, wait: Duration) -> Vec<api::RegisterRequest> {
        let mut out = Vec::new();
        while let Ok(Some(r)) = tokio::time::timeout(wait, self.registrations.recv()).await {
            out.push(r);
        }
        out
    }

    /// A client for a registered endpoint, as the kubelet dials it.
    pub async fn dial(&self, endpoint: &str) -> anyhow::Result<DevicePluginClient<Channel>> {
        Ok(DevicePluginClient::new(
            crate::uds::channel(&self.dir.join(endpoint)).await?,
        ))
    }
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
