//! Publishes the node's ResourceSlices (one pool, named after the node): created when
//! missing, replaced with the pool's generation bumped when the node's devices change (an
//! unhealthy card's devices tainted, or left out where the API server does not serve device
//! taints), and withdrawn while the node does not give its GPUs to DRA (its `tessera.io/dra`
//! label is not `true`: they are the device-plugin path's, and a card offered through both
//! could be booked twice). With dynamic MIG the cards' counter sets go in slices of their own.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1 as resource;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use tessera_core::dra::{self, Published};
use tessera_core::names::{LABEL_DRA, dynamic_mig, offers_dra};
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

/// Keeps node `node`'s slices in line with what it was last given and the node's labels.
pub struct SlicePublisher {
    api: Api<resource::ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    /// What was last written; `None` before the first write and after a withdrawal.
    published: Option<Published>,
    /// Whether the slices are known to be absent (withdrawn, or checked).
    withdrawn: bool,
    /// The API server dropped the devices' taints (device taints not served): tainted devices
    /// are left out instead, or they would be offered as if healthy.
    taints_dropped: bool,
}

impl SlicePublisher {
    /// A publisher for node `node`, writing its ResourceSlices and reading its labels.
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

    /// The node's slices of this driver as the API server has them.
    async fn existing(&self) -> Result<Vec<resource::ResourceSlice>, kube::Error> {
        let params = ListParams::default().fields(&format!("spec.nodeName={},spec.driver={}", self.node, dra::DRIVER));
        let list = self.api.list(&params).await?;
        Ok(list
            .items
            .into_iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(self.node.as_str()) && s.spec.driver == dra::DRIVER)
            .collect())
    }

    /// Publishes what `published` gives (told whether the node asks for dynamic MIG) when the
    /// node gives its GPUs to DRA and it is not what was last published; withdraws the slices
    /// when the node does not. The API server canonicalises quantities, so what was sent (not
    /// what it returns) is what is compared.
    pub async fn sync(&mut self, published: impl FnOnce(bool) -> Published) -> Result<Synced, kube::Error> {
        let node = self.nodes.get(&self.node).await?;
        let labels = node.metadata.labels.as_ref();
        if !offers_dra(labels) {
            if self.withdrawn {
                return Ok(Synced::Unchanged);
            }
            let existing = self.existing().await?;
            for old in &existing {
                let name = old.metadata.name.clone().unwrap_or_default();
                match self.api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
            info!(
                node = self.node,
                withdrawn = existing.len(),
                "the node's GPUs are not for DRA ({LABEL_DRA} is not true): no slice published"
            );
            self.published = None;
            self.withdrawn = true;
            return Ok(Synced::Withdrawn);
        }
        self.withdrawn = false;
        let wanted = published(dynamic_mig(labels));
        loop {
            let mut wanted = wanted.clone();
            if self.taints_dropped {
                wanted.devices = dra::untainted(&wanted.devices);
            }
            if self.published.as_ref() == Some(&wanted) {
                return Ok(Synced::Unchanged);
            }
            let existing = self.existing().await?;
            let generation = existing.iter().map(|s| s.spec.pool.generation).max().unwrap_or(0) + 1;
            let mut kept_taints = false;
            let slices = dra::slices(&self.node, generation, &wanted);
            for mut slice in slices.iter().cloned() {
                let name = slice.metadata.name.clone().unwrap_or_default();
                let written = match existing.iter().find(|o| o.metadata.name.as_deref() == Some(&name)) {
                    None => self.api.create(&PostParams::default(), &slice).await?,
                    Some(old) => {
                        slice.metadata.resource_version = old.metadata.resource_version.clone();
                        self.api.replace(&name, &PostParams::default(), &slice).await?
                    }
                };
                kept_taints |= written.spec.devices.iter().flatten().any(|d| d.taints.is_some());
            }
            // Slices of an older layout (more devices or cards before) go last: until then the
            // pool at the new generation is complete, the old ones are ignored.
            for old in &existing {
                let name = old.metadata.name.clone().unwrap_or_default();
                if slices.iter().all(|s| s.metadata.name.as_deref() != Some(&name)) {
                    match self.api.delete(&name, &DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            self.published = Some(wanted.clone());
            let sent_taints = wanted.devices.iter().any(|d| d.taints.is_some());
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
