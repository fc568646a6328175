//! Where the plugin reads claims, namespaces and its node: the API server, or a test's fake.

use k8s_openapi::api::resource::v1::ResourceClaim;

/// Where claims are read from: the API server, or a test's fake.
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name` as the API server has it now.
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String>;

    /// The tenant namespace `namespace` belongs to: its `tessera.io/tenant` label, else itself.
    async fn tenant(&self, namespace: &str) -> Result<String, String> {
        Ok(namespace.to_string())
    }

    /// Whether node `node` lets one card's shares go to different tenants
    /// (`tessera.io/cross-tenant-sharing=true`).
    async fn cross_tenant(&self, _node: &str) -> Result<bool, String> {
        Ok(false)
    }
}

/// Claims read from the API server.
pub struct ApiClaims(pub kube::Client);

#[tonic::async_trait]
impl ClaimSource for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        kube::Api::<ResourceClaim>::namespaced(self.0.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| format!("reading claim {namespace}/{name}: {e}"))
    }

    async fn tenant(&self, namespace: &str) -> Result<String, String> {
        let ns = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(self.0.clone())
            .get(namespace)
            .await
            .map_err(|e| format!("reading namespace {namespace}: {e}"))?;
        Ok(ns
            .metadata
            .labels
            .and_then(|l| l.get(tessera_core::names::LABEL_TENANT).cloned())
            .unwrap_or_else(|| namespace.to_string()))
    }

    async fn cross_tenant(&self, node: &str) -> Result<bool, String> {
        let n = kube::Api::<k8s_openapi::api::core::v1::Node>::all(self.0.clone())
            .get(node)
            .await
            .map_err(|e| format!("reading node {node}: {e}"))?;
        Ok(n.metadata
            .labels
            .and_then(|l| l.get(tessera_core::names::LABEL_CROSS_TENANT_SHARING).cloned())
            .is_some_and(|v| v == "true"))
    }
}
