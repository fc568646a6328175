//! A front for the sockets the kubelet dials. The kubelet's plugin watcher (grpc-go dialing a
//! bare socket path) sends that path as the HTTP/2 `:authority` of its requests; the h2 server
//! under tonic refuses such an authority and resets the stream (PROTOCOL_ERROR), so the kubelet
//! never learns who the plugin is. Each accepted connection is relayed to the gRPC server
//! through an in-process pipe; the client's header blocks are decoded and written again with
//! `:authority: localhost` (what grpc-go itself sends over `unix:` targets). Everything else,
//! and the whole server-to-client direction, passes through untouched.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, DuplexStream};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::debug;

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame payload every HTTP/2 peer accepts.
const MAX_FRAME: usize = 16_384;
/// The most a header block may grow to before the connection is dropped.
const MAX_BLOCK: usize = 256 * 1024;

/// Accepts connections on `listener` and hands the gRPC server their relayed ends, as a stream
/// for `serve_with_incoming`.
pub fn front(listener: UnixListener) -> ReceiverStream<io::Result<DuplexStream>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let (client, _) = match listener.accept().await {
                Ok(c) => c,
                // Out of descriptors and the like: the listener stays; try again shortly.
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (server_end, relay_end) = tokio::io::duplex(64 * 1024);
            if tx.send(Ok(server_end)).await.is_err() {
                return;
            }
            tokio::spawn(async move {
                if let Err(e) = relay(client, relay_end).await {
                    debug!(error = %e, "relayed connection ended");
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

async fn relay<C, S>(client: C, server: S) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let up = async {
        let r = rewrite_requests(&mut client_read, &mut server_write).await;
        let _ = server_write.shutdown().await;
        r
    };
    let down = async {
        let r = tokio::io::copy(&mut server_read, &mut client_write).await.map(|_| ());
        let _ = client_write.shutdown().await;
        r
    };
    let (a, b) = tokio::join!(up, down);
    a.and(b)
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Copies the client's HTTP/2 stream to the server, its header blocks rewritten.
async fn rewrite_requests<R, W>(from: &mut R, to: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(bad("not an HTTP/2 client"));
    }
    to.write_all(&preface).await?;
    let mut decoder = loona_hpack::Decoder::new();
    // The server advertises HTTP/2's default table size: the client may not use more.
    decoder.set_max_allowed_table_size(4096);
    // A header block being gathered from HEADERS and CONTINUATION frames.
    let mut pending: Option<(u32, u8, Vec<u8>)> = None;
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        from.read_exact(&mut payload).await?;
        match (kind, &mut pending) {
            (HEADERS, None) => {
                let fragment = headers_fragment(flags, &payload)?;
                pending = Some((stream, flags & END_STREAM, fragment.to_vec()));
            }
            (CONTINUATION, Some((id, _, block))) if *id == stream => {
                block.extend_from_slice(&payload);
                if block.len() > MAX_BLOCK {
                    return Err(bad("header block too large"));
                }
            }
            (_, Some(_)) => return Err(bad("a frame inside a header block")),
            _ => {
                to.write_all(&head).await?;
                to.write_all(&payload).await?;
                continue;
            }
        }
        if flags & END_HEADERS != 0 {
            let (id, end_stream, block) = pending.take().expect("gathering");
            let fields = decoder
                .decode(&block)
                .map_err(|e| bad(&format!("undecodable header block: {e:?}")))?;
            write_headers(to, id, end_stream, &with_local_authority(fields)).await?;
        }
    }
}

/// The header block fragment of a HEADERS frame's payload (padding and priority removed).
fn headers_fragment(flags: u8, payload: &[u8]) -> io::Result<&[u8]> {
    let mut p = payload;
    let mut pad = 0usize;
    if flags & PADDED != 0 {
        let (&n, rest) = p.split_first().ok_or_else(|| bad("short HEADERS frame"))?;
        pad = usize::from(n);
        p = rest;
    }
    if flags & PRIORITY != 0 {
        p = p.get(5..).ok_or_else(|| bad("short HEADERS frame"))?;
    }
    p.get(..p.len().checked_sub(pad).ok_or_else(|| bad("bad padding"))?)
        .ok_or_else(|| bad("bad padding"))
}

/// `fields` with `:authority` set to `localhost`.
pub fn with_local_authority(fields: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<(Vec<u8>, Vec<u8>)> {
    fields
        .into_iter()
        .map(|(name, value)| {
            if name == b":authority" {
                (name, b"localhost".to_vec())
            } else {
                (name, value)
            }
        })
        .collect()
}

/// Encodes `fields` as HPACK literals without indexing (no table state to share with the
/// server's decoder).
pub fn encode_literal(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    fn int(out: &mut Vec<u8>, first: u8, prefix_bits: u32, mut v: usize) {
        let max = (1usize << prefix_bits) - 1;
        if v < max {
            out.push(first | v as u8);
            return;
        }
        out.push(first | max as u8);
        v -= max;
        while v >= 128 {
            out.push((v % 128) as u8 | 0x80);
            v /= 128;
        }
        out.push(v as u8);
    }
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x00);
        int(&mut out, 0, 7, name.len());
        out.extend_from_slice(name);
        int(&mut out, 0, 7, value.len());
        out.extend_from_slice(value);
    }
    out
}

async fn write_headers<W: AsyncWrite + Unpin>(
    to: &mut W,
    stream: u32,
    end_stream: u8,
    fields: &[(Vec<u8>, Vec<u8>)],
) -> io::Result<()> {
    let block = encode_literal(fields);
    let chunks: Vec<&[u8]> = if block.is_empty() {
        vec![&[]]
    } else {
        block.chunks(MAX_FRAME).collect()
    };
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let (kind, mut flags) = if i == 0 {
            (HEADERS, end_stream)
        } else {
            (CONTINUATION, 0)
        };
        if last {
            flags |= END_HEADERS;
        }
        let len = chunk.len();
        let mut head = [0u8; 9];
        head[..3].copy_from_slice(&(len as u32).to_be_bytes()[1..]);
        head[3] = kind;
        head[4] = flags;
        head[5..].copy_from_slice(&stream.to_be_bytes());
        to.write_all(&head).await?;
        to.write_all(chunk).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let fields = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (b":path".to_vec(), b"/pluginregistration.Registration/GetInfo".to_vec()),
            (
                b":authority".to_vec(),
                b"/var/lib/kubelet/plugins_registry/gpu.tessera.io-reg.sock".to_vec(),
            ),
            (b"content-type".to_vec(), b"application/grpc".to_vec()),
            (b"user-agent".to_vec(), vec![b'x'; 300]),
        ];
        // As the client sent it (indexed, Huffman-coded by a real encoder), decoded, rewritten,
        // and decoded again by a fresh decoder as the server's would.
        let sent = loona_hpack::Encoder::new().encode(fields.iter().map(|(n, v)| (&n[..], &v[..])));
        let got = loona_hpack::Decoder::new().decode(&sent).unwrap();
        let out = encode_literal(&with_local_authority(got));
        let seen = loona_hpack::Decoder::new().decode(&out).unwrap();
        let mut want = fields.clone();
        want[3].1 = b"localhost".to_vec();
        assert_eq!(seen, want);
        assert!(http::uri::Authority::from_maybe_shared(seen[3].1.clone()).is_ok());
        assert!(http::uri::Authority::from_maybe_shared(fields[3].1.clone()).is_err());
    }

    #[test]
    fn padding_and_priority_are_taken_off_a_headers_frame() {
        let block = [0x82u8, 0x86];
        let mut payload = vec![3u8];
        payload.extend_from_slice(&[0, 0, 0, 0, 16]);
        payload.extend_from_slice(&block);
        payload.extend_from_slice(&[0, 0, 0]);
        assert_eq!(headers_fragment(PADDED | PRIORITY, &payload).unwrap(), block);
        assert!(headers_fragment(PADDED, &[9, 1]).is_err());
    }
}
