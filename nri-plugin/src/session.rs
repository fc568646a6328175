//! Connecting to the runtime: serve the plugin service on conn 1, then register on conn 2;
//! when the runtime goes away (EOF), reconnect with backoff.

use std::os::fd::{FromRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use tessera_proto::nri::api;
use tessera_proto::nri::api_ttrpc::{RuntimeClient, create_plugin};
use tracing::{info, warn};
use ttrpc::r#async::transport::{Listener, Socket};
use ttrpc::r#async::{Client, Server};

use crate::mux::{self, PLUGIN_CONN, RUNTIME_CONN};
use crate::plugin::TesseraPlugin;

/// The name the plugin registers under.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Plugin name (`tessera`).
    pub name: String,
    /// Two-digit index (`10`).
    pub idx: String,
}

/// One session over a connected socket; returns when the runtime closes it.
pub async fn session(stream: tokio::net::UnixStream, id: &Identity, plugin: Arc<TesseraPlugin>) -> anyhow::Result<()> {
    let mut m = mux::split(stream, &[PLUGIN_CONN, RUNTIME_CONN]);
    let plugin_conn = m.conns.remove(&PLUGIN_CONN).expect("opened");
    let runtime_conn = m.conns.remove(&RUNTIME_CONN).expect("opened");
    // Serve first: Configure arrives right after registration. The listener yields the one
    // connection and then stays pending (an ended listener makes the server panic at stop).
    let incoming = tokio_stream::iter([Ok::<_, std::io::Error>(plugin_conn)]).chain(tokio_stream::pending());
    let mut server = Server::new()
        .register_service(create_plugin(plugin))
        .add_listener(Listener::new(incoming));
    server.start().await?;
    let client = RuntimeClient::new(Client::new(Socket::new(runtime_conn)));
    let mut req = api::RegisterPluginRequest::new();
    req.plugin_name = id.name.clone();
    req.plugin_idx = id.idx.clone();
    client
        .register_plugin(
            ttrpc::context::with_timeout(Duration::from_secs(5).as_nanos() as i64),
            &req,
        )
        .await
        .map_err(|e| anyhow::anyhow!("RegisterPlugin: {e}"))?;
    info!(name = id.name, idx = id.idx, "registered with the runtime");
    let _ = m.closed.await;
    let _ = server.shutdown().await;
    Ok(())
}

/// Runs as an external plugin on `socket`, reconnecting with backoff (100 ms doubling to 5 s)
/// whenever the runtime restarts. Returns only on shutdown.
pub async fn run_external(
    socket: std::path::PathBuf,
    id: Identity,
    plugin: Arc<TesseraPlugin>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let stream = tokio::net::UnixStream::connect(&socket).await?;
            session(stream, &id, plugin.clone()).await
        };
        tokio::select! {
            r = attempt => match r {
                Ok(()) => {
                    info!("the runtime closed the connection; reconnecting");
                    backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    warn!(socket = %socket.display(), error = format!("{e:#}"), retry_in = ?backoff, "cannot reach the runtime");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = &mut shutdown => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            },
            _ = &mut shutdown => return,
        }
    }
}

/// Runs as a plugin launched by the runtime, on the inherited socket `fd`.
pub async fn run_launched(fd: RawFd, id: Identity, plugin: Arc<TesseraPlugin>) -> anyhow::Result<()> {
    // SAFETY: the runtime hands us this socket as fd 3 and nothing else owns it.
    let std_stream = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    std_stream.set_nonblocking(true)?;
    session(tokio::net::UnixStream::from_std(std_stream)?, &id, plugin).await
}
