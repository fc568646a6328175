//! gRPC channels over Unix sockets.

use std::path::Path;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// A channel to the gRPC server on `socket`.
pub async fn channel(socket: &Path) -> anyhow::Result<Channel> {
    let socket = socket.to_path_buf();
    Ok(Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await?)
}
