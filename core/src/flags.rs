//! Flag values every command line checks alike, as clap value parsers.
//!
//! Each parser takes the flag's text and says, on refusal, what a good value is; clap puts the
//! flag and the value in front (`invalid value 'mps' for '--mps-root <MPS_ROOT>': a host path
//! must be absolute`). Host paths, intervals, the memory unit and listen addresses are checked
//! here so that every binary refuses the same nonsense with the same words.

use std::net::SocketAddr;
use std::path::PathBuf;

/// A host path (a directory or socket shared with the runtime, the other agents or the
/// containers): absolute, since each of them would resolve a relative one from its own
/// working directory, and a CDI spec must name host paths.
pub fn host_path(s: &str) -> Result<PathBuf, String> {
    if s.is_empty() {
        return Err("a host path must not be empty".into());
    }
    if !s.starts_with('/') {
        return Err("a host path must be absolute".into());
    }
    Ok(PathBuf::from(s))
}

/// A whole number of seconds or milliseconds between two rounds of work: at least 1, since 0
/// would repeat the work without pause (a core spent on polling).
pub fn interval(s: &str) -> Result<u64, String> {
    let n: u64 = s.parse().map_err(|_| "not a whole number".to_string())?;
    if n == 0 {
        return Err("an interval must be at least 1 (0 would repeat the work without pause)".into());
    }
    Ok(n)
}

/// MiB in one unit of `tessera.io/gpu-memory`: at least 1 (0 would make every memory request
/// ask for nothing).
pub fn memory_unit_mib(s: &str) -> Result<u64, String> {
    let n: u64 = s.parse().map_err(|_| "not a whole number of MiB".to_string())?;
    if n == 0 {
        return Err("the memory unit must be at least 1 MiB".into());
    }
    Ok(n)
}

/// An address to listen on: `IP:PORT` (an IPv6 address in brackets), the port 1..=65535.
pub fn listen_address(s: &str) -> Result<SocketAddr, String> {
    const SHAPE: &str = "expected IP:PORT, e.g. 0.0.0.0:8888 or [::]:8888";
    const PORTS: &str = "a port is 1..=65535";
    match s.parse::<SocketAddr>() {
        Ok(a) if a.port() == 0 => Err(format!("port 0: {PORTS}")),
        Ok(a) => Ok(a),
        Err(_) => {
            let Some((host, port)) = s.rsplit_once(':') else {
                return Err(format!("no port: {SHAPE}"));
            };
            if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("port {port:?} is not a number: {PORTS}"));
            }
            if port.parse::<u16>().is_err() {
                return Err(format!("port {port}: {PORTS}"));
            }
            Err(format!("{host:?} is not an IP address: {SHAPE}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_paths_are_absolute() {
        assert_eq!(host_path("/run/tessera/mps"), Ok(PathBuf::from("/run/tessera/mps")));
        assert_eq!(host_path("mps"), Err("a host path must be absolute".into()));
        assert_eq!(host_path("./cdi"), Err("a host path must be absolute".into()));
        assert_eq!(host_path(""), Err("a host path must not be empty".into()));
    }

    #[test]
    fn intervals_and_the_memory_unit_are_at_least_one() {
        assert_eq!(interval("5"), Ok(5));
        assert!(interval("0").unwrap_err().contains("at least 1"));
        assert!(interval("-1").unwrap_err().contains("not a whole number"));
        assert_eq!(memory_unit_mib("1024"), Ok(1024));
        assert!(memory_unit_mib("0").unwrap_err().contains("at least 1 MiB"));
    }

    #[test]
    fn listen_addresses_name_what_is_wrong() {
        assert_eq!(listen_address("0.0.0.0:8888").unwrap().port(), 8888);
        assert_eq!(listen_address("[::1]:9443").unwrap().port(), 9443);
        for (bad, want) in [
            ("0.0.0.0:99999", "port 99999: a port is 1..=65535"),
            ("0.0.0.0:0", "port 0: a port is 1..=65535"),
            ("0.0.0.0:http", "port \"http\" is not a number"),
            ("0.0.0.0:", "port \"\" is not a number"),
            ("8888", "no port: expected IP:PORT"),
            ("localhost:8888", "\"localhost\" is not an IP address"),
        ] {
            let e = listen_address(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
