//! The gRPC face of a [`Preparer`]: the kubelet's NodePrepareResources and
//! NodeUnprepareResources, each claim answered on its own.

use std::sync::Arc;

use tessera_proto::dra as api;
use tessera_proto::dra::dra_plugin_server::DraPlugin;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::{ClaimError, Preparer};

/// The gRPC face of a [`Preparer`].
pub struct DraService(pub Arc<Preparer>);

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<api::NodePrepareResourcesRequest>,
    ) -> Result<Response<api::NodePrepareResourcesResponse>, Status> {
        let asked = tokio::time::Instant::now();
        let mut claims = std::collections::HashMap::new();
        let mut waiting: Vec<(String, Vec<String>)> = Vec::new();
        for c in request.into_inner().claims {
            let key = format!("{}/{}", c.namespace, c.name);
            // A claim whose MIG slices another claim's instance holds waits a while for that
            // claim's unprepare (the kubelet's, of a pod just deleted) rather than failing
            // into the kubelet's back-off: the lock is free meanwhile.
            let mut said = false;
            let prepared = loop {
                match self.0.prepare(&c).await {
                    Err(ClaimError::HeldByClaim { holder, .. }) if asked.elapsed() < self.0.held_wait() => {
                        if !std::mem::replace(&mut said, true) {
                            info!(
                                claim = key,
                                holder, "waits for the claim whose MIG instance is in its way"
                            );
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    }
                    other => break other,
                }
            };
            let answer = match prepared {
                Ok((devices, instances)) => {
                    if !instances.is_empty() {
                        waiting.push((c.uid.clone(), instances));
                    }
                    api::NodePrepareResourceResponse {
                        devices,
                        error: String::new(),
                    }
                }
                Err(e) => {
                    let error = e.to_string();
                    warn!(claim = key, uid = c.uid, error, "cannot prepare");
                    api::NodePrepareResourceResponse { devices: vec![], error }
                }
            };
            claims.insert(c.uid, answer);
        }
        // The instances made for the request's claims, waited for once, outside the lock: a
        // container gets one once the CDI generator lists it.
        let all: Vec<String> = waiting.iter().flat_map(|(_, u)| u.iter().cloned()).collect();
        if let Err(missing) = self.0.wait_for_cdi(&all, asked).await {
            for (uid, instances) in waiting {
                let late: Vec<&String> = instances.iter().filter(|u| missing.contains(u)).collect();
                if late.is_empty() {
                    continue;
                }
                let answer = claims.get_mut(&uid).expect("answered above");
                answer.devices.clear();
                answer.error = format!(
                    "claim {uid}: MIG instance(s) {late:?} made, but the node's CDI spec does not list them yet \
                     (tessera-cdi-generator lists them at its next reading of the cards); asked again, the prepare waits again"
                );
                warn!(uid, error = answer.error, "cannot prepare yet");
            }
        }
        Ok(Response::new(api::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<api::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<api::NodeUnprepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for c in request.into_inner().claims {
            let error = self
                .0
                .unprepare(&c.uid)
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            claims.insert(c.uid, api::NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(api::NodeUnprepareResourcesResponse { claims }))
    }
}
