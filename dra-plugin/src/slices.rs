//! Publishes the node's ResourceSlice: created when missing, replaced with the pool's
//! generation bumped when the node's devices change.

use k8s_openapi::api::resource::v1 as resource;
use kube::Api;
use kube::api::PostParams;
use tessera_core::dra;

/// Keeps node `node`'s slice in line with the devices it was last given.
pub struct SlicePublisher {
    api: Api<resource::ResourceSlice>,
    node: String,
    published: Option<Vec<resource::Device>>,
}

impl SlicePublisher {
    /// A publisher writing through `api` (cluster-scoped ResourceSlices).
    pub fn new(api: Api<resource::ResourceSlice>, node: &str) -> Self {
        Self {
            api,
            node: node.into(),
            published: None,
        }
    }

    /// Publishes `devices` unless they are what was last published; returns the pool's
    /// generation when it wrote. The API server canonicalises quantities, so what was sent
    /// (not what it returns) is what is compared.
    pub async fn publish(&mut self, devices: Vec<resource::Device>) -> Result<Option<i64>, kube::Error> {
        if self.published.as_ref() == Some(&devices) {
            return Ok(None);
        }
        let name = dra::slice_name(&self.node);
        let generation = match self.api.get_opt(&name).await? {
            None => {
                let slice = dra::slice(&self.node, 1, devices.clone());
                self.api.create(&PostParams::default(), &slice).await?;
                1
            }
            Some(old) => {
                let generation = old.spec.pool.generation + 1;
                let mut slice = dra::slice(&self.node, generation, devices.clone());
                slice.metadata.resource_version = old.metadata.resource_version;
                self.api.replace(&name, &PostParams::default(), &slice).await?;
                generation
            }
        };
        self.published = Some(devices);
        Ok(Some(generation))
    }
}
