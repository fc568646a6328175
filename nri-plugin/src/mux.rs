//! NRI's connection multiplexer: several byte streams over one socket, in frames of
//! `[conn id u32 BE][length u32 BE][payload]`. Conn 1 carries the plugin service (we serve),
//! conn 2 the runtime service (we call).
//!
//! Every frame we send is at most [`MAX_FRAME`] bytes: the Go side reads through a 4 KiB
//! buffer and drops the connection on a larger frame.

use std::collections::HashMap;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::sync::{mpsc, oneshot};

/// Largest frame we send, header included.
pub const MAX_FRAME: usize = 4096;
const HEADER: usize = 8;
/// Largest payload per frame.
pub const MAX_PAYLOAD: usize = MAX_FRAME - HEADER;
/// The plugin service's connection.
pub const PLUGIN_CONN: u32 = 1;
/// The runtime service's connection.
pub const RUNTIME_CONN: u32 = 2;

/// Encodes one frame.
pub fn frame(conn: u32, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() <= MAX_PAYLOAD, "frames are at most {MAX_FRAME} bytes");
    let mut f = Vec::with_capacity(HEADER + payload.len());
    f.extend_from_slice(&conn.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A multiplexed socket: the logical connections, and a receiver that fires when the socket
/// closes (EOF or error).
pub struct Mux {
    /// One stream per requested conn id.
    pub conns: HashMap<u32, DuplexStream>,
    /// Resolves when the underlying socket is closed.
    pub closed: oneshot::Receiver<()>,
}

/// Splits `socket` into the logical connections `ids`.
pub fn split<S>(socket: S, ids: &[u32]) -> Mux
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(socket);
    let (frames_tx, mut frames_rx) = mpsc::channel::<Vec<u8>>(64);
    // Set when the socket closes: the pumps then drop their halves so the conns see EOF.
    let (gone_tx, gone_rx) = tokio::sync::watch::channel(false);
    let mut conns = HashMap::new();
    let mut sinks = HashMap::new();
    for &id in ids {
        let (ours, theirs) = tokio::io::duplex(256 * 1024);
        let (mut from_conn, to_conn) = tokio::io::split(theirs);
        sinks.insert(id, to_conn);
        conns.insert(id, ours);
        let frames_tx = frames_tx.clone();
        let mut gone = gone_rx.clone();
        // Pump: whatever the conn's user writes goes out in frames of at most MAX_FRAME.
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_PAYLOAD];
            loop {
                let read = tokio::select! {
                    r = from_conn.read(&mut buf) => r,
                    _ = gone.wait_for(|g| *g) => return,
                };
                match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if frames_tx.send(frame(id, &buf[..n])).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
    drop(frames_tx);
    tokio::spawn(async move {
        while let Some(f) = frames_rx.recv().await {
            if wr.write_all(&f).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let (closed_tx, closed) = oneshot::channel();
    tokio::spawn(async move {
        let mut header = [0u8; HEADER];
        let mut payload = Vec::new();
        loop {
            if rd.read_exact(&mut header).await.is_err() {
                break;
            }
            let id = u32::from_be_bytes(header[..4].try_into().expect("4 bytes"));
            let len = u32::from_be_bytes(header[4..].try_into().expect("4 bytes")) as usize;
            payload.resize(len, 0);
            if rd.read_exact(&mut payload).await.is_err() {
                break;
            }
            // Frames for connections nobody opened are dropped, as the Go side does.
            if let Some(sink) = sinks.get_mut(&id)
                && sink.write_all(&payload).await.is_err()
            {
                sinks.remove(&id);
            }
        }
        // Closing the sinks and stopping the pumps gives the conn users EOF.
        drop(sinks);
        let _ = gone_tx.send(true);
        let _ = closed_tx.send(());
    });
    Mux { conns, closed }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_stay_small_and_route_by_conn() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut mux = split(a, &[PLUGIN_CONN, RUNTIME_CONN]);
        let mut runtime = mux.conns.remove(&RUNTIME_CONN).unwrap();
        let mut plugin = mux.conns.remove(&PLUGIN_CONN).unwrap();
        // A 20 KB message written at once leaves as several frames, none over 4096 bytes.
        let big: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
        runtime.write_all(&big).await.unwrap();
        let mut got = Vec::new();
        while got.len() < big.len() {
            let mut h = [0u8; 8];
            b.read_exact(&mut h).await.unwrap();
            let id = u32::from_be_bytes(h[..4].try_into().unwrap());
            let len = u32::from_be_bytes(h[4..].try_into().unwrap()) as usize;
            assert_eq!(id, RUNTIME_CONN);
            assert!(len + 8 <= MAX_FRAME, "frame of {} bytes", len + 8);
            let mut p = vec![0; len];
            b.read_exact(&mut p).await.unwrap();
            got.extend(p);
        }
        assert_eq!(got, big);
        // Incoming frames reach their conn; unknown conns are dropped; big frames are fine.
        let incoming: Vec<u8> = vec![7; 10_000];
        let mut raw = Vec::new();
        raw.extend_from_slice(&9u32.to_be_bytes());
        raw.extend_from_slice(&3u32.to_be_bytes());
        raw.extend_from_slice(b"xyz");
        raw.extend_from_slice(&PLUGIN_CONN.to_be_bytes());
        raw.extend_from_slice(&(incoming.len() as u32).to_be_bytes());
        raw.extend_from_slice(&incoming);
        b.write_all(&raw).await.unwrap();
        let mut back = vec![0u8; incoming.len()];
        plugin.read_exact(&mut back).await.unwrap();
        assert_eq!(back, incoming);
        // EOF on the socket closes the conns and fires `closed`.
        drop(b);
        let mut rest = Vec::new();
        assert_eq!(plugin.read_to_end(&mut rest).await.unwrap(), 0);
        mux.closed.await.unwrap();
    }
}
