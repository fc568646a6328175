//! The daemon's output: read line by line whatever its bytes, told apart from control chatter.

use std::process::Stdio;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, AsyncReadExt as _, BufReader};
use tokio::process::{Child, Command};
use tracing::{debug, info};

use super::SupervisorConfig;
use crate::tamper::Tally;

/// The last thing a daemon said that was not health-check chatter (why it would not start).
pub(super) type LastWords = Arc<Mutex<Option<String>>>;

/// Where the daemon's output stands in a control connection's lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Ui {
    /// No connection open.
    #[default]
    Idle,
    /// A connection open, waiting for its command (a client that holds one open and says
    /// nothing stays here: the daemon's other lines must still be seen).
    Open,
    /// A command logged: the next line is its answer (or the next command).
    Command,
    /// The answer read.
    Answered,
}

/// The control daemon logs five lines per control connection (`-f`): its accepting, `NEW UI`,
/// the command, the answer and `UI closed`. They are noise: the supervisor's own checks and
/// ceilings, and clients' commands, which the card's [`Tally`] counts and its supervision
/// reports (a flood of commands is not a flood of log lines). Returns whether `line` is such,
/// tracking where in a connection the daemon is: only a connection's own lines are noise, so a
/// server's exit said while a client holds a connection open is still logged.
fn chatter(line: &str, ui: &mut Ui) -> bool {
    let text = line
        .strip_prefix('[')
        .and_then(|rest| rest.split_once("] "))
        .map_or(line, |(_, t)| t)
        .trim();
    match text {
        "Accepting connection..." => true,
        "NEW UI" => {
            *ui = Ui::Open;
            true
        }
        "UI closed" => {
            *ui = Ui::Idle;
            true
        }
        t if t.starts_with("Cmd:") && *ui != Ui::Idle => {
            *ui = Ui::Command;
            true
        }
        _ if *ui == Ui::Command => {
            *ui = Ui::Answered;
            true
        }
        _ => false,
    }
}

/// The longest line of the daemon's output read: the rest of a longer one (a client's long
/// command) is dropped.
const MAX_LINE: u64 = 8192;

/// Reads the next line of `reader` into `buf`, without its newline and cut to [`MAX_LINE`]
/// bytes, whatever bytes it holds; false at the end.
async fn next_line<R: AsyncBufRead + Unpin>(reader: &mut R, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    buf.clear();
    if (&mut *reader).take(MAX_LINE).read_until(b'\n', buf).await? == 0 {
        return Ok(false);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        return Ok(true);
    }
    // Cut short (or the last line): the rest of it is dropped.
    loop {
        let chunk = reader.fill_buf().await?;
        match chunk.iter().position(|&b| b == b'\n') {
            _ if chunk.is_empty() => return Ok(true),
            Some(at) => {
                reader.consume(at + 1);
                return Ok(true);
            }
            None => {
                let all = chunk.len();
                reader.consume(all);
            }
        }
    }
}

pub(super) fn spawn(config: &SupervisorConfig, uuid: &str, last: &LastWords) -> std::io::Result<(Child, Arc<Tally>)> {
    let tally = Arc::new(Tally::default());
    let mut child = Command::new(&config.exec_self)
        .arg("exec-daemon")
        .arg("--shm")
        .arg(config.layout.shm_dir(uuid))
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--")
        .arg(&config.binaries.control)
        .arg("-f")
        .envs(config.binaries.env(&config.layout, uuid))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // The daemon's own output, as log lines naming its card; the commands in it, told.
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let uuid = uuid.to_string();
        let last = last.clone();
        let tally = tally.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stream);
            let mut buf = Vec::new();
            let mut ui = Ui::Idle;
            // Any bytes a client sends are logged back: a line that is no UTF-8 is read too.
            while let Ok(true) = next_line(&mut reader, &mut buf).await {
                let line = String::from_utf8_lossy(&buf);
                let command = tally.hear(&line);
                if chatter(&line, &mut ui) || command.is_some() {
                    debug!(uuid, "mps-control: {line}");
                } else {
                    info!(uuid, "mps-control: {line}");
                    *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(line.into_owned());
                }
            }
        });
    }
    Ok((child, tally))
}

/// Why the daemon ended, with the last thing it said.
pub(super) fn with_last_words(reason: String, last: &LastWords) -> String {
    match last.lock().unwrap_or_else(|e| e.into_inner()).take() {
        Some(words) => format!(
            "{reason}: {}",
            words.rsplit_once("] ").map_or(words.as_str(), |(_, t)| t).trim()
        ),
        None => reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_daemons_output_is_read_whatever_its_bytes() {
        // A client's command comes back in the daemon's log as it was sent: bytes that are no
        // UTF-8, a line longer than any the daemon writes of its own.
        let mut out = b"[t Control 1] Cmd:set_default_active_thread_percentage 100 \xff\n".to_vec();
        out.extend(vec![b'y'; 3 * MAX_LINE as usize]);
        out.extend(b"\n[t Control 1] UI closed\nno newline");
        let mut reader = BufReader::with_capacity(64, &out[..]);
        let (mut buf, mut lines) = (Vec::new(), Vec::new());
        while next_line(&mut reader, &mut buf).await.unwrap() {
            lines.push(buf.clone());
        }
        assert_eq!(
            lines,
            [
                b"[t Control 1] Cmd:set_default_active_thread_percentage 100 \xff".to_vec(),
                vec![b'y'; MAX_LINE as usize],
                b"[t Control 1] UI closed".to_vec(),
                b"no newline".to_vec(),
            ]
        );
    }

    #[test]
    fn a_control_connections_lines_are_chatter() {
        let mut ui = Ui::Idle;
        let chatty: Vec<bool> = [
            "Starting control daemon using socket /x/control",
            "Accepting connection...",
            "NEW UI",
            "Cmd:set_default_active_thread_percentage 100",
            "100.0",
            "UI closed",
            "Server 12400 exited with status 1",
            // A client that holds a connection open and says nothing hides nothing.
            "Accepting connection...",
            "NEW UI",
            "Server 12401 exited with status 1",
            "Cmd:get_default_active_thread_percentage",
            "30.0",
            "Cannot start server: out of memory",
        ]
        .iter()
        .map(|l| chatter(&format!("[2026-11-24 02:05:10.267 Control 14056] {l}"), &mut ui))
        .collect();
        assert_eq!(
            chatty,
            [
                false, true, true, true, true, true, false, true, true, false, true, true, false
            ]
        );
    }
}
