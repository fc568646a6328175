//! The thin gRPC layer: one DevicePlugin server per resource, translating kubelet calls into
//! resource-manager calls.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use tessera_core::inventory::NodeInventory;

use tessera_proto::deviceplugin as api;
use tessera_proto::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use tokio::sync::{oneshot, watch};
use tokio_stream::Stream;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tonic::{Request, Response, Status};

use crate::resources::{self, HEALTHY, UNHEALTHY, Unit};

/// One resource's DevicePlugin service.
#[derive(Clone)]
pub struct PluginService {
    resource: String,
    devices: watch::Receiver<Vec<Unit>>,
    /// The node's cards and how they are connected (for whole-card preferred allocations).
    cards: watch::Receiver<Option<Arc<NodeInventory>>>,
    memory_unit_mib: u64,
}

fn to_api(units: &[Unit]) -> api::ListAndWatchResponse {
    api::ListAndWatchResponse {
        devices: units
            .iter()
            .map(|u| api::Device {
                id: u.id.clone(),
                health: if u.healthy { HEALTHY } else { UNHEALTHY }.into(),
                topology: u.numa.map(|n| api::TopologyInfo {
                    nodes: vec![api::NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(api::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: !self.resource.starts_with(tessera_core::names::RESOURCE_MIG_PREFIX),
        }))
    }

    type ListAndWatchStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

    async fn list_and_watch(&self, _: Request<api::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        // The full list now and on every change; the stream ends when the endpoint stops.
        let stream = WatchStream::new(self.devices.clone()).map(|units| Ok(to_api(&units)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let cards = self.cards.borrow().clone();
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|r| api::ContainerPreferredAllocationResponse {
                device_i_ds: resources::preferred(
                    cards.as_deref(),
                    &r.available_device_i_ds,
                    &r.must_include_device_i_ds,
                    usize::try_from(r.allocation_size).unwrap_or(0),
                ),
            })
            .collect();
        Ok(Response::new(api::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let known: BTreeSet<String> = self.devices.borrow().iter().map(|u| u.id.clone()).collect();
        let mut container_responses = Vec::new();
        // One response per container request, in order. No device nodes: the NRI plugin
        // injects devices from the hand-off.
        for (i, r) in request.into_inner().container_requests.iter().enumerate() {
            let annotations =
                resources::allocate_annotations(&self.resource, i, &r.devices_ids, &known, self.memory_unit_mib)
                    .map_err(|e| Status::invalid_argument(e.to_string()))?;
            container_responses.push(api::ContainerAllocateResponse {
                annotations: annotations.into_iter().collect(),
                ..Default::default()
            });
        }
        Ok(Response::new(api::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// A running endpoint: its socket, its device list and its server task.
pub struct Endpoint {
    /// Resource name.
    pub resource: String,
    /// Socket path.
    pub socket: PathBuf,
    /// Publishes device-list changes to ListAndWatch streams.
    pub devices: watch::Sender<Vec<Unit>>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

/// The socket file name of a resource's endpoint (`tessera-gpu-core.sock`).
pub fn socket_name(resource: &str) -> String {
    format!("tessera-{}.sock", resources::suffix(resource).replace('/', "-"))
}

impl Endpoint {
    /// Removes a stale socket, binds and serves (before registration, as kubelet requires).
    pub fn start(
        dir: &Path,
        resource: &str,
        units: Vec<Unit>,
        cards: watch::Receiver<Option<Arc<NodeInventory>>>,
        memory_unit_mib: u64,
    ) -> std::io::Result<Self> {
        let socket = dir.join(socket_name(resource));
        match std::fs::remove_file(&socket) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let (devices, rx) = watch::channel(units);
        let service = PluginService {
            resource: resource.to_string(),
            devices: rx,
            cards,
            memory_unit_mib,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let result = tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(service))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await;
            if let Err(e) = result {
                tracing::warn!(error = %e, "device plugin server stopped with an error");
            }
        });
        Ok(Self {
            resource: resource.to_string(),
            socket,
            devices,
            stop: Some(stop),
            task,
        })
    }

    /// Stops serving and removes the socket.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // Close ListAndWatch streams so the server can finish.
        drop(self.devices);
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), &mut self.task).await;
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}
