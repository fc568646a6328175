//! The kubelet's plugin registration: a Registration service on a socket in the kubelet's
//! `plugins_registry` directory, answering who this plugin is and where its DRA service is.

use std::path::{Path, PathBuf};

use tessera_core::dra::DRIVER;
use tessera_proto::pluginregistration as api;
use tessera_proto::pluginregistration::registration_server::Registration;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

/// The gRPC service this plugin serves on its DRA socket, as the kubelet names it.
pub const DRA_SERVICE_V1: &str = "v1.DRAPlugin";
/// The plugin type the kubelet routes to its DRA manager.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// The registration socket's file name in the kubelet's registry directory.
pub fn socket_name() -> String {
    format!("{DRIVER}-reg.sock")
}

/// Answers the kubelet's registration calls.
pub struct Registrar {
    endpoint: PathBuf,
    status: watch::Sender<Option<Result<(), String>>>,
}

impl Registrar {
    /// A registrar announcing the DRA service at `endpoint` (the path as the kubelet sees it);
    /// the receiver sees the kubelet's verdicts.
    pub fn new(endpoint: &Path) -> (Self, watch::Receiver<Option<Result<(), String>>>) {
        let (status, rx) = watch::channel(None);
        (
            Self {
                endpoint: endpoint.to_path_buf(),
                status,
            },
            rx,
        )
    }
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<api::InfoRequest>) -> Result<Response<api::PluginInfo>, Status> {
        Ok(Response::new(api::PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: DRIVER.into(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![DRA_SERVICE_V1.into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<api::RegistrationStatus>,
    ) -> Result<Response<api::RegistrationStatusResponse>, Status> {
        let s = request.into_inner();
        if s.plugin_registered {
            info!(driver = DRIVER, "registered with the kubelet");
            self.status.send_replace(Some(Ok(())));
        } else {
            warn!(driver = DRIVER, error = s.error, "the kubelet refused the registration");
            self.status.send_replace(Some(Err(s.error)));
        }
        Ok(Response::new(api::RegistrationStatusResponse {}))
    }
}
