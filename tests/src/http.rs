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
        // it is sent (hyper reports it as canceled, or the connection as closed): reconnect
        // once.
        match self.send(path, body.clone()).await {
            Err(e)
                if e.downcast_ref::<hyper::Error>()
                    .is_some_and(|h| h.is_canceled() || h.is_closed()) =>
            {
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

/// POSTs a body larger than the server accepts, as Go's client (kube-scheduler's) does: the
/// body is written in the background while the reply is read, so a server that answers early
/// (413) and resets the connection is still heard. Returns the status line's code and the body.
pub async fn post_oversized(addr: SocketAddr, path: &str, body: Vec<u8>) -> anyhow::Result<(u16, Vec<u8>)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut rd, mut wr) = stream.into_split();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let writer = tokio::spawn(async move {
        // The server may stop reading and reset the connection: that is its answer.
        let _ = wr.write_all(head.as_bytes()).await;
        let _ = wr.write_all(&body).await;
    });
    let mut reply = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match rd.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            // The reset after the reply: what was read is the reply.
            Err(e) if !reply.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => return Err(e.into()),
        }
        if let Some(end) = reply.windows(4).position(|w| w == b"\r\n\r\n") {
            let headers = String::from_utf8_lossy(&reply[..end]).to_ascii_lowercase();
            let len = headers
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if len.is_some_and(|l| reply.len() >= end + 4 + l) {
                break;
            }
        }
    }
    writer.abort();
    let text = String::from_utf8_lossy(&reply);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no HTTP status in {:?}", text.chars().take(80).collect::<String>()))?;
    let body = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| reply[i + 4..].to_vec())
        .unwrap_or_default();
    Ok((status, body))
}
