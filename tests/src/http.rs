//! A small keep-alive HTTP/1.1 JSON client, as kube-scheduler talks to an extender.

use std::net::SocketAddr;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, header};
use hyper_util::rt::TokioIo;

/// One connection, reopened when the server closes it.
pub struct JsonClient {
    addr: SocketAddr,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl JsonClient {
    /// A client for `addr` (connects on first use).
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr, sender: None }
    }

    async fn sender(&mut self) -> anyhow::Result<&mut SendRequest<Full<Bytes>>> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            let stream = tokio::net::TcpStream::connect(self.addr).await?;
            stream.set_nodelay(true)?;
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            self.sender = Some(sender);
        }
        Ok(self.sender.as_mut().expect("connected"))
    }

    /// Sends `body` to `path` (POST, or GET when `body` is `None`); returns the status and
    /// the body bytes.
    pub async fn request(&mut self, path: &str, body: Option<Vec<u8>>) -> anyhow::Result<(u16, Vec<u8>)> {
        // A connection the server closed after its last reply fails the next request before
        // it is sent (hyper reports it as canceled): reconnect once.
        match self.send(path, body.clone()).await {
            Err(e) if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_canceled) => {
                self.sender = None;
                self.send(path, body).await
            }
            r => r,
        }
    }

    async fn send(&mut self, path: &str, body: Option<Vec<u8>>) -> anyhow::Result<(u16, Vec<u8>)> {
        let host = self.addr.to_string();
        let req = match body {
            Some(b) => Request::post(path)
                .header(header::HOST, host)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(b)))?,
            None => Request::get(path)
                .header(header::HOST, host)
                .body(Full::new(Bytes::new()))?,
        };
        let sender = self.sender().await?;
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes().to_vec();
        Ok((status, body))
    }

    /// POSTs JSON and parses the JSON reply.
    pub async fn post_json(
        &mut self,
        path: &str,
        body: &serde_json::Value,
    ) -> anyhow::Result<(u16, serde_json::Value)> {
        let (status, bytes) = self.request(path, Some(serde_json::to_vec(body)?)).await?;
        let v = serde_json::from_slice(&bytes).map_err(|e| {
            anyhow::anyhow!(
                "reply to {path} ({status}) is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        })?;
        Ok((status, v))
    }

    /// GET, returning the status.
    pub async fn get_status(&mut self, path: &str) -> anyhow::Result<u16> {
        Ok(self.request(path, None).await?.0)
    }
}
