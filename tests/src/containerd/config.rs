//! containerd configuration on private paths.

use std::path::Path;

use super::Version;

/// Private paths of one containerd instance.
pub struct Paths<'a> {
    /// Instance directory (root, state, sockets, CDI and NRI dirs live below it).
    pub dir: &'a Path,
    /// runc binary.
    pub runc: &'a Path,
    /// Sandbox (pause) image name.
    pub image: &'a str,
}

impl Paths<'_> {
    fn p(&self, rel: &str) -> String {
        self.dir.join(rel).display().to_string()
    }
}

/// The config file content for `version`.
pub fn render(version: Version, paths: &Paths<'_>) -> String {
    let common = format!(
        r#"root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "{nri}"
  plugin_path = "{nri_plugins}"
  plugin_config_path = "{nri_conf}"
"#,
        root = paths.p("root"),
        state = paths.p("state"),
        sock = paths.p("containerd.sock"),
        nri = paths.p("nri.sock"),
        nri_plugins = paths.p("nri-plugins"),
        nri_conf = paths.p("nri-conf"),
    );
    let runc = paths.runc.display();
    let cdi = paths.p("cdi");
    let (cni_bin, cni_conf) = (paths.p("cni/bin"), paths.p("cni/conf"));
    let image = paths.image;
    match version {
        Version::V1_7 => format!(
            r#"version = 2
{common}[plugins."io.containerd.grpc.v1.cri"]
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
  sandbox_image = "{image}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"#
        ),
        Version::V2 => format!(
            r#"version = 3
{common}[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  cdi_spec_dirs = ["{cdi}"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{image}"
"#
        ),
    }
}
