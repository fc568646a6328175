//! The DRA device health stream the kubelet watches (`v1alpha1.DRAResourceHealth`): every
//! device's health when the kubelet connects and again whenever the node's cards change.

use std::pin::Pin;
use std::sync::Arc;

use tessera_core::dra;
use tessera_core::inventory::NodeInventory;
use tessera_proto::drahealth as api;
use tessera_proto::drahealth::dra_resource_health_server::DraResourceHealth;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Serves the health of node `node`'s devices from its card readings.
pub struct HealthService {
    /// This node (the pool's name).
    pub node: String,
    /// The node's cards as last read.
    pub inventory: watch::Receiver<Option<Arc<NodeInventory>>>,
    /// Turns true when the plugin stops: open streams end then.
    pub stop: watch::Receiver<bool>,
}

/// The kubelet's view of `inv`'s devices, stamped `now` (Unix seconds).
pub fn report(node: &str, inv: &NodeInventory, now: i64) -> api::NodeWatchResourcesResponse {
    api::NodeWatchResourcesResponse {
        devices: dra::device_health(inv)
            .into_iter()
            .map(|(device, why)| api::DeviceHealth {
                device: Some(api::DeviceIdentifier {
                    pool_name: node.into(),
                    device_name: device,
                }),
                health: if why.is_some() {
                    api::HealthStatus::Unhealthy
                } else {
                    api::HealthStatus::Healthy
                } as i32,
                last_updated_time: now,
                health_check_timeout_seconds: 0,
                message: why.unwrap_or_default(),
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = Pin<Box<dyn Stream<Item = Result<api::NodeWatchResourcesResponse, Status>> + Send>>;

    async fn node_watch_resources(
        &self,
        _: Request<api::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let (node, mut inventory, mut stop) = (self.node.clone(), self.inventory.clone(), self.stop.clone());
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            inventory.mark_changed();
            loop {
                tokio::select! {
                    changed = inventory.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let inv = inventory.borrow_and_update().clone();
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_secs() as i64);
                        if let Some(inv) = inv
                            && tx.send(Ok(report(&node, &inv, now))).await.is_err()
                        {
                            return;
                        }
                    }
                    _ = stop.changed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
