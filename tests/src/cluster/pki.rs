//! The cluster's certificates and kubeconfigs, made with `openssl`: one CA for every component
//! (client certificates name the user and groups the API server's RBAC and Node authorizers
//! see), a front-proxy CA, and the service-account key pair.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// The API server's address (loopback in the cluster's network namespace).
pub const SERVER: &str = "https://127.0.0.1:6443";

fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn ca(dir: &Path, name: &str, cn: &str) -> anyhow::Result<()> {
    openssl(dir, &["genrsa", "-out", &format!("{name}.key"), "2048"])?;
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            &format!("{name}.key"),
            "-sha256",
            "-days",
            "30",
            "-subj",
            &format!("/CN={cn}"),
            "-out",
            &format!("{name}.crt"),
        ],
    )
}

/// A certificate `name` signed by `ca`: `subject` as openssl writes it, `san` a
/// subjectAltName list (empty for none), `usage` `clientAuth` or `serverAuth`.
fn cert(dir: &Path, ca: &str, name: &str, subject: &str, san: &str, usage: &str) -> anyhow::Result<()> {
    openssl(dir, &["genrsa", "-out", &format!("{name}.key"), "2048"])?;
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &format!("{name}.key"),
            "-subj",
            subject,
            "-out",
            &format!("{name}.csr"),
        ],
    )?;
    let mut ext = format!(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
    );
    if !san.is_empty() {
        ext += &format!("subjectAltName={san}\n");
    }
    std::fs::write(dir.join(format!("{name}.ext")), ext)?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "30",
            "-sha256",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.crt"),
        ],
    )
}

/// The files made, under one directory.
#[derive(Debug, Clone)]
pub struct Pki {
    /// Where they are.
    pub dir: PathBuf,
}

impl Pki {
    /// Makes every certificate the cluster needs for node `node` at `node_ip`.
    pub fn make(dir: &Path, node: &str, node_ip: &str) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        ca(dir, "ca", "tessera-test-ca")?;
        ca(dir, "front-proxy-ca", "tessera-test-front-proxy-ca")?;
        openssl(dir, &["genrsa", "-out", "sa.key", "2048"])?;
        openssl(dir, &["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        let apiserver_san = format!(
            "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,\
             DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:127.96.0.1,IP:{node_ip}"
        );
        cert(
            dir,
            "ca",
            "apiserver",
            "/CN=kube-apiserver",
            &apiserver_san,
            "serverAuth",
        )?;
        for (name, subject) in [
            (
                "apiserver-kubelet-client",
                "/O=system:masters/CN=kube-apiserver-kubelet-client",
            ),
            ("admin", "/O=system:masters/CN=kubernetes-admin"),
            ("controller-manager", "/CN=system:kube-controller-manager"),
            ("scheduler", "/CN=system:kube-scheduler"),
            ("kubelet-client", &format!("/O=system:nodes/CN=system:node:{node}")),
        ] {
            cert(dir, "ca", name, subject, "", "clientAuth")?;
        }
        cert(
            dir,
            "ca",
            "kubelet-serving",
            &format!("/O=system:nodes/CN=system:node:{node}"),
            &format!("DNS:{node},DNS:localhost,IP:127.0.0.1,IP:{node_ip}"),
            "serverAuth",
        )?;
        cert(
            dir,
            "front-proxy-ca",
            "front-proxy-client",
            "/CN=front-proxy-client",
            "",
            "clientAuth",
        )?;
        Ok(Self { dir: dir.to_path_buf() })
    }

    /// A file of the set (`ca.crt`, `sa.key`, ...).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes a kubeconfig at `path` for the user of certificate `name`.
    pub fn kubeconfig(&self, name: &str, path: &Path) -> anyhow::Result<PathBuf> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster: {{server: \"{SERVER}\", \
             certificate-authority: \"{ca}\"}}\nusers:\n- name: {name}\n  user: {{client-certificate: \"{crt}\", \
             client-key: \"{key}\"}}\ncontexts:\n- name: {name}\n  context: {{cluster: local, user: {name}}}\n\
             current-context: {name}\n",
            ca = self.file("ca.crt").display(),
            crt = self.file(&format!("{name}.crt")).display(),
            key = self.file(&format!("{name}.key")).display(),
        );
        std::fs::write(path, text)?;
        Ok(path.to_path_buf())
    }
}
