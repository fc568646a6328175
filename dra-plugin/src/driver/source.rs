//! Where the plugin reads claims, namespaces and its node: the API server, or a test's fake.

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::SourceError;

/// Where claims are read from: the API server, or a test's fake.
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name` as the API server has it now.
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, SourceError>;

    /// The tenant namespace `namespace` belongs to: its `tessera.io/tenant` label, else itself.
    async fn tenant(&self, namespace: &str) -> Result<String, SourceError> {
        Ok(namespace.to_string())
    }

    /// Whether node `node` lets one card's shares go to different tenants
    /// (`tessera.io/cross-tenant-sharing=true`).
    async fn cross_tenant(&self, _node: &str) -> Result<bool, SourceError> {
        Ok(false)
    }
}

/// Claims read from the API server.
pub struct ApiClaims(pub kube::Client);

#[tonic::async_trait]
impl ClaimSource for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, SourceError> {
        kube::Api::<ResourceClaim>::namespaced(self.0.clone(), namespace)
            .get(name)
            .await
            .map_err(|source| SourceError::Api {
                what: format!("claim {namespace}/{name}"),
                source,
            })
    }

    async fn tenant(&self, namespace: &str) -> Result<String, SourceError> {
        let ns = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(self.0.clone())
            .get(namespace)
            .await
            .map_err(|source| SourceError::Api {
                what: format!("namespace {namespace}"),
                source,
            })?;
        Ok(ns
            .metadata
            .labels
            .and_then(|l| l.get(tessera_core::names::LABEL_TENANT).cloned())
            .unwrap_or_else(|| namespace.to_string()))
    }

    async fn cross_tenant(&self, node: &str) -> Result<bool, SourceError> {
        let n = kube::Api::<k8s_openapi::api::core::v1::Node>::all(self.0.clone())
            .get(node)
            .await
            .map_err(|source| SourceError::Api {
                what: format!("node {node}"),
                source,
            })?;
        Ok(n.metadata
            .labels
            .and_then(|l| l.get(tessera_core::names::LABEL_CROSS_TENANT_SHARING).cloned())
            .is_some_and(|v| v == "true"))
    }
}
