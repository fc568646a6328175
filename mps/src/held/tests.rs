use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};

use super::*;

/// `/proc/<pid>/net/unix` of the real 535 daemon holding a client's connection (read by hand):
/// its two listeners, a client connecting to the privileged one, and the connection it took.
const DAEMON_TABLE: &str = "\
Num       RefCount Protocol Flags    Type St Inode Path
00000000d36617a5: 00000002 00000000 00000000 0005 02     0 /run/mps/pipe/control_privileged
0000000065e759b4: 00000002 00000000 00010000 0005 01 1320818 /run/mps/pipe/control_privileged
00000000c84f19a8: 00000002 00000000 00010000 0005 01 1320819 /run/mps/pipe/control
00000000385b8005: 00000003 00000000 00000000 0005 03 1322796 /run/mps/pipe/control
00000000385b8006: 00000003 00000000 00000000 0005 03 1322797 /run/a dir/control
00000000385b8007: 00000003 00000000 00000000 0005 03 1322798 /run/mps/pipe/not-control
00000000385b8008: 00000003 00000000 00000000 0001 03 1322799
";

#[test]
fn connections_taken_on_control_are_told_from_listeners_and_other_sockets() {
    assert_eq!(accepted_on_control(DAEMON_TABLE), HashSet::from([1_322_796, 1_322_797]));
    assert_eq!(socket_inode(OsStr::new("socket:[1322796]")), Some(1_322_796));
    assert_eq!(socket_inode(OsStr::new("pipe:[1322796]")), None);
}

#[test]
fn this_process_s_own_connections_are_listed_by_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let listener = UnixListener::bind(dir.path().join("control")).unwrap();
    let other = UnixListener::bind(dir.path().join("control_privileged")).unwrap();
    let _client = UnixStream::connect(dir.path().join("control")).unwrap();
    let _other_client = UnixStream::connect(dir.path().join("control_privileged")).unwrap();
    let (taken, _) = listener.accept().unwrap();
    let _ = other.accept().unwrap();
    let held = connections(std::process::id()).unwrap();
    let inode = nix::sys::stat::fstat(taken.as_fd()).unwrap().st_ino;
    assert!(
        held.contains(&Held {
            fd: taken.as_raw_fd(),
            inode
        }),
        "{held:?}"
    );
    // Neither listener, the clients' ends nor the other socket's connection.
    for fd in [listener.as_raw_fd(), other.as_raw_fd(), _client.as_raw_fd()] {
        assert!(held.iter().all(|h| h.fd != fd), "{fd} in {held:?}");
    }
}

#[test]
fn a_process_descends_from_its_parents_only() {
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let (me, kid) = (std::process::id(), child.id());
    assert!(descends_from(i32::try_from(kid).unwrap(), me));
    assert!(descends_from(i32::try_from(me).unwrap(), me));
    assert!(!descends_from(i32::try_from(me).unwrap(), kid));
    assert!(!descends_from(1, me));
    assert!(!descends_from(0, me));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A stand-in daemon: takes one connection on `<dir>/control`, says so, and then reports the
/// end of its input or, with `busy`, reads nothing (as a daemon held up elsewhere).
fn stand_in_daemon(dir: &Path, busy: bool) -> std::process::Child {
    let script = "import socket, sys, time\n\
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
        s.bind(sys.argv[1]); s.listen(4)\n\
        print('listening', flush=True)\n\
        c, _ = s.accept()\n\
        print('accepted', flush=True)\n\
        if sys.argv[2] == 'busy': time.sleep(60)\n\
        print('eof' if c.recv(16) == b'' else 'data', flush=True)\n";
    Command::new("python3")
        .args(["-c", script])
        .arg(dir.join("control"))
        .arg(if busy { "busy" } else { "reads" })
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A stand-in daemon that has taken this process's connection, and that connection.
fn held_by_stand_in(dir: &Path, busy: bool) -> (std::process::Child, BufReader<std::process::ChildStdout>, UnixStream) {
    let mut daemon = stand_in_daemon(dir, busy);
    let mut out = BufReader::new(daemon.stdout.take().unwrap());
    assert_eq!(said(&mut out), "listening");
    let client = UnixStream::connect(dir.join("control")).unwrap();
    assert_eq!(said(&mut out), "accepted");
    (daemon, out, client)
}

/// The stand-in daemon's next line.
fn said(out: &mut BufReader<std::process::ChildStdout>) -> String {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    line.trim().to_string()
}

#[test]
fn a_held_connection_is_shut_down_from_the_daemon_s_side() {
    let dir = tempfile::tempdir().unwrap();
    // This process is the client that connects and says nothing.
    let (mut daemon, mut out, _client) = held_by_stand_in(dir.path(), false);
    let pid = daemon.id();
    let held = connections(pid).unwrap();
    assert_eq!(held.len(), 1, "{held:?}");

    // A descriptor that now names another socket is not touched.
    let stale = Held {
        inode: held[0].inode + 1,
        ..held[0]
    };
    assert_eq!(cut(pid, stale).unwrap(), Outcome::Gone);

    let me = i32::try_from(std::process::id()).unwrap();
    match cut(pid, held[0]).unwrap() {
        Outcome::Cut(peer) => {
            assert_eq!(peer.pid, me);
            assert_eq!(peer.uid, nix::unistd::getuid().as_raw());
            assert_eq!(peer.cgroup, cgroup_of(me));
        }
        other => panic!("not cut: {other:?}"),
    }
    // The daemon reads the end of its input and is free again.
    assert_eq!(said(&mut out), "eof");
    assert!(daemon.wait().unwrap().success());
    // Once the daemon is gone, there is nothing to cut.
    assert!(!matches!(cut(pid, held[0]), Ok(Outcome::Cut(_))));
}

#[test]
fn a_client_that_has_spoken_or_hung_up_is_not_what_holds_the_daemon() {
    for hang_up in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // A daemon busy elsewhere: it does not read what its client sent.
        let (mut daemon, _out, mut client) = held_by_stand_in(dir.path(), true);
        if hang_up {
            client.shutdown(std::net::Shutdown::Both).unwrap();
        } else {
            client.write_all(b"get_server_list\n").unwrap();
        }
        let held = connections(daemon.id()).unwrap();
        assert_eq!(held.len(), 1, "{held:?}");
        assert_eq!(cut(daemon.id(), held[0]).unwrap(), Outcome::Gone, "hung up: {hang_up}");
        if !hang_up {
            // Left open: the client's end has nothing to read, no end of input.
            client.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            let read = std::io::Read::read(&mut client, &mut b);
            assert!(
                read.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
                "{read:?}"
            );
        }
        daemon.kill().unwrap();
        daemon.wait().unwrap();
    }
}

#[test]
fn a_connection_of_a_client_the_daemon_started_is_kept() {
    // This process plays the daemon, and its own connection's client descends from it.
    let dir = tempfile::tempdir().unwrap();
    let listener = UnixListener::bind(dir.path().join("control")).unwrap();
    let mut client = UnixStream::connect(dir.path().join("control")).unwrap();
    let (mut taken, _) = listener.accept().unwrap();
    let inode = nix::sys::stat::fstat(taken.as_fd()).unwrap().st_ino;
    let held = Held {
        fd: taken.as_raw_fd(),
        inode,
    };
    let me = std::process::id();
    assert!(matches!(cut(me, held).unwrap(), Outcome::Kept(p) if p.pid == i32::try_from(me).unwrap()));
    // Still open both ways.
    client.write_all(b"x").unwrap();
    let mut b = [0u8; 1];
    std::io::Read::read_exact(&mut taken, &mut b).unwrap();
    taken.write_all(b"y").unwrap();
    std::io::Read::read_exact(&mut client, &mut b).unwrap();
    assert_eq!(&b, b"y");
}
