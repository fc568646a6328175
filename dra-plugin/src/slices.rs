//! Publishes the node's ResourceSlice: created when missing, replaced with the pool's
//! generation bumped when the node's devices change (an unhealthy card's devices tainted, or
//! left out where the API server does not serve device taints), and withdrawn while the node does not
//! give its GPUs to DRA (its `tessera.io/dra` label is not `true`: they are the device-plugin
//! path's, and a card offered through both could be booked twice).

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as resource;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use tessera_core::dra;
use tessera_core::names::{LABEL_DRA, offers_dra};
use tracing::{info, warn};

/// What a [`SlicePublisher::sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synced {
    /// Nothing to change.
    Unchanged,
    /// The slice was written, at this pool generation.
    Published(i64),
    /// The slice was removed (or was absent): the node does not give its GPUs to DRA.
    Withdrawn,
}

/// Keeps node `node`'s slice in line with the devices it was last given and the node's label.
pub struct SlicePublisher {
    api: Api<resource::ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    /// What was last written; `None` before the first write and after a withdrawal.
    published: Option<Vec<resource::Device>>,
    /// Whether the slice is known to be absent (withdrawn, or checked).
    withdrawn: bool,
    /// The API server dropped the devices' taints (device taints not served): tainted devices
    /// are left out instead, or they would be offered as if healthy.
    taints_dropped: bool,
}

impl SlicePublisher {
    /// A publisher for node `node`, writing its ResourceSlice and reading its labels.
    pub fn new(client: Client, node: &str) -> Self {
        Self {
            api: Api::all(client.clone()),
            nodes: Api::all(client),
            node: node.into(),
            published: None,
            withdrawn: false,
            taints_dropped: false,
        }
    }

    /// Publishes `devices` when the node gives its GPUs to DRA and they are not what was last
    /// published; withdraws the slice when the node does not. The API server canonicalises
    /// quantities, so what was sent (not what it returns) is what is compared.
    pub async fn sync(&mut self, devices: Vec<resource::Device>) -> Result<Synced, kube::Error> {
        let node = self.nodes.get(&self.node).await?;
        if !offers_dra(node.metadata.labels.as_ref()) {
            if self.withdrawn {
                return Ok(Synced::Unchanged);
            }
            let name = dra::slice_name(&self.node);
            match self.api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => info!(
                    node = self.node,
                    "the node's GPUs are not for DRA ({LABEL_DRA} is not true): slice withdrawn"
                ),
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    info!(
                        node = self.node,
                        "the node's GPUs are not for DRA ({LABEL_DRA} is not true): no slice published"
                    )
                }
                Err(e) => return Err(e),
            }
            self.published = None;
            self.withdrawn = true;
            return Ok(Synced::Withdrawn);
        }
        self.withdrawn = false;
        loop {
            let devices = if self.taints_dropped {
                dra::untainted(&devices)
            } else {
                devices.clone()
            };
            if self.published.as_ref() == Some(&devices) {
                return Ok(Synced::Unchanged);
            }
            let name = dra::slice_name(&self.node);
            let (generation, written) = match self.api.get_opt(&name).await? {
                None => {
                    let slice = dra::slice(&self.node, 1, devices.clone());
                    (1, self.api.create(&PostParams::default(), &slice).await?)
                }
                Some(old) => {
                    let generation = old.spec.pool.generation + 1;
                    let mut slice = dra::slice(&self.node, generation, devices.clone());
                    slice.metadata.resource_version = old.metadata.resource_version;
                    (
                        generation,
                        self.api.replace(&name, &PostParams::default(), &slice).await?,
                    )
                }
            };
            self.published = Some(devices.clone());
            let sent_taints = devices.iter().any(|d| d.taints.is_some());
            let kept_taints = written.spec.devices.iter().flatten().any(|d| d.taints.is_some());
            if sent_taints && !kept_taints {
                warn!(
                    node = self.node,
                    "the API server dropped the devices' taints (DRADeviceTaints off): unhealthy cards are left out of the slice instead"
                );
                self.taints_dropped = true;
                continue;
            }
            return Ok(Synced::Published(generation));
        }
    }
}
