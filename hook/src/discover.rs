//! Finding this process's host pid (NVML names GPU processes by host pid; the container has its
//! own pid namespace): the node agent answers on the container's own socket with the connecting
//! process's pid as the host sees it (the kernel's peer credentials). Nothing is shared with
//! another container and nothing waits for one (a card-wide lock used to order context
//! creations, and one tenant could hold it against the others).

use std::io::Read as _;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The longest the agent is waited for.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// This process's host pid, as the agent on `socket` answers it.
pub fn host_pid(socket: &Path) -> Option<u32> {
    let s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(ASK_TIMEOUT)).ok()?;
    let mut answer = String::new();
    s.take(32).read_to_string(&mut answer).ok()?;
    answer.trim().parse().ok().filter(|p| *p > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_answer_is_one_positive_number() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("pid.sock");
        let l = UnixListener::bind(&path).unwrap();
        let serve = |answer: &'static str| {
            let l = l.try_clone().unwrap();
            std::thread::spawn(move || {
                let (mut c, _) = l.accept().unwrap();
                c.write_all(answer.as_bytes()).unwrap();
            })
        };
        for (answer, want) in [("4242\n", Some(4242)), ("0\n", None), ("nope", None), ("", None)] {
            let t = serve(answer);
            assert_eq!(host_pid(&path), want, "{answer:?}");
            t.join().unwrap();
        }
        assert_eq!(host_pid(&d.path().join("absent")), None);
    }
}
