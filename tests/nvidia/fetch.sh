#!/usr/bin/env bash
# Fetches NVIDIA's real driver userspace from Debian's non-free component, for two driver
# branches (bookworm's 535 and trixie's 550), without touching the system's apt configuration
# and without installing anything: each package is unpacked with `dpkg -x` under a cache
# folder. From those real files it builds one fake host root per layout GPU nodes really have:
#
#   distro    Debian's own packaging: files under /usr/lib/<triplet>/nvidia/current, the
#             update-alternatives links the nvidia-alternative package's postinst makes
#             (replayed from that script), /etc/ld.so.cache made by `ldconfig -r`
#   gke       /usr/local/nvidia/{lib64,bin,firmware/nvidia/<v>}, lib64 in the host's ld cache
#   cos       /home/kubernetes/bin/nvidia/{lib64,bin,firmware/nvidia/<v>}, in no ld cache
#   operator  the GPU operator's driver container at /run/nvidia/driver (a runfile-style root
#             with its own ld cache), nothing of the driver on the host itself
#
# Plus the unpacked packages themselves (`pkg`: run the real nvidia-cuda-mps-control from
# there), the CUDA 11.8 runtime (bookworm's libcudart11.0), LLVM's OpenMP (libomp5-14) and
# bookworm's glibc (libc6, for container images whose programs load libcuda) and bullseye's
# glibc 2.31 with its programs (the oldest glibc reachable here, for the hook).
# All programs here run on bookworm's glibc 2.36 (they need GLIBC_2.9 at most).
#
#   tests/nvidia/fetch.sh [CACHE_DIR]      (default: <repo>/.cache/nvidia)
#
# Prints one line per item: NAME VERSION PATH, e.g. `535/distro 535.261.03 /…/535/distro`.
# Idempotent and safe to run concurrently; nothing outside CACHE_DIR is written.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../private-apt.sh"
# Bump the ready file when the recipe changes.
open_cache "${1:-${TESSERA_NVIDIA_CACHE:-$here/../../.cache/nvidia}}" ready-v4 "${TESSERA_REFRESH_NVIDIA:-}"
private_apt "$cache/apt" \
  "deb http://deb.debian.org/debian bullseye main" \
  "deb http://deb.debian.org/debian bookworm main non-free non-free-firmware" \
  "deb http://deb.debian.org/debian trixie main non-free non-free-firmware"

# Downloads PACKAGE=VERSION (once) and unpacks it into DEST.
unpack() { # PACKAGE VERSION DEST
  local deb
  deb="$(ls "$apt_dir/debs" | grep -F "$1_$(echo "$2" | sed 's/:/%3a/')_" | head -n 1 || true)"
  if [ -z "$deb" ]; then
    (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" -qq download "$1=$2" >/dev/null)
    deb="$(ls "$apt_dir/debs" | grep -F "$1_$(echo "$2" | sed 's/:/%3a/')_" | head -n 1)"
  fi
  dpkg -x "$apt_dir/debs/$deb" "$3"
}

# The driver's compute, utility and video userspace (what Tessera gives GPU containers), the
# MPS programs, GSP firmware, and nvidia-alternative (whose postinst says where the links go).
driver_packages=(
  libcuda1 libnvidia-ml1 nvidia-smi nvidia-cuda-mps firmware-nvidia-gsp
  libnvidia-ptxjitcompiler1 libnvidia-nvvm4 libnvidia-allocator1 libnvidia-cfg1
  libcudadebugger1 libnvidia-pkcs11-openssl3 nvidia-opencl-icd libnvcuvid1
  libnvidia-encode1 libnvidia-opticalflow1 nvidia-alternative
)
triplet=x86_64-linux-gnu

# Replays nvidia-alternative's postinst under ROOT: for every `add_slave` /
# `add_multiarch_slave` line whose source file exists there, the link update-alternatives
# makes (TARGET -> /etc/alternatives/NAME -> SOURCE).
replay_alternatives() { # ROOT POSTINST
  local root="$1" postinst="$2" defs
  defs="$(sed -n '/^TRIPLETS=/p; /^add_multiarch_slave()/,/^}/p' "$postinst")"
  (
    set +u # the package's functions read optional arguments
    eval "$defs"
    # The package's add_slave, with its existence checks made under ROOT.
    add_slave() {
      if [ -f "$root$3" ] && [ -d "$root$(dirname "$1")" ]; then echo "$1 nvidia--$2 $3"; fi
    }
    grep -o '\$(add_[a-z_]*slave [^)]*)' "$postinst" | sed 's/^\$(//; s/)$//' | sort -u |
      while read -r line; do eval "$line"; done
  ) | sort -u | while read -r target name source; do
    mkdir -p "$root/etc/alternatives" "$root$(dirname "$target")"
    ln -sfn "$source" "$root/etc/alternatives/$name"
    ln -sfn "/etc/alternatives/$name" "$root$target"
  done
}

# Glibc's search list as Debian configures it, so `ldconfig -r` caches what a real host would.
ld_conf() { # ROOT DIR...
  local root="$1"
  shift
  mkdir -p "$root/etc/ld.so.conf.d"
  echo 'include /etc/ld.so.conf.d/*.conf' > "$root/etc/ld.so.conf"
  printf '%s\n' "$@" > "$root/etc/ld.so.conf.d/tessera-test.conf"
  ldconfig -r "$root"
}

# A flat driver directory as NVIDIA's runfile installs it: every versioned library in LIBDIR
# with its soname link, every program in BINDIR, firmware in FWDIR/nvidia/<version>.
flat() { # PKG LIBDIR BINDIR FWDIR VERSION
  local pkg="$1" lib="$2" bin="$3" fw="$4" v="$5" f so
  mkdir -p "$lib" "$bin" "$fw/nvidia"
  find "$pkg/usr/lib/$triplet" -type f -name "lib*.so.$v" -exec cp -l {} "$lib/" \;
  for f in "$lib"/lib*.so."$v"; do
    so="$(objdump -p "$f" | awk '/SONAME/ { print $2 }')"
    if [ -n "$so" ] && [ "$so" != "$(basename "$f")" ]; then ln -sfn "$(basename "$f")" "$lib/$so"; fi
  done
  for f in "$pkg/usr/lib/nvidia/current/nvidia-smi" "$pkg/usr/bin/nvidia-cuda-mps-control" \
    "$pkg/usr/sbin/nvidia-cuda-mps-server"; do
    cp -l "$f" "$bin/"
  done
  # bookworm's package puts firmware in /lib/firmware, trixie's (merged /usr) in /usr/lib/firmware.
  cp -al "$(ls -d "$pkg"/lib/firmware/nvidia/"$v" "$pkg"/usr/lib/firmware/nvidia/"$v" 2>/dev/null | head -n 1)" "$fw/nvidia/$v"
}

build_branch() { # NAME SUITE PREFIX
  local name="$1" suite="$2" prefix="$3" v deb_v dir pkg p
  deb_v="$(pick libcuda1 "$suite" "$prefix")"
  [ -n "$deb_v" ] || { echo "fetch.sh: no libcuda1 $prefix* in $suite" >&2; exit 1; }
  v="${deb_v%%-*}"
  dir="$cache/$name"
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  pkg="$dir.tmp/pkg"
  mkdir -p "$pkg"
  for p in "${driver_packages[@]}"; do unpack "$p" "$deb_v" "$pkg"; done
  # libnvidia-gpucomp exists from 550 on.
  if [ -n "$(pick libnvidia-gpucomp "$suite" "$deb_v")" ]; then unpack libnvidia-gpucomp "$deb_v" "$pkg"; fi
  dpkg-deb -e "$apt_dir/debs/$(ls "$apt_dir/debs" | grep -F "nvidia-alternative_${deb_v}_")" "$dir.tmp/nvidia-alternative.control"
  rm -rf "$pkg/usr/share/doc" "$pkg/usr/share/man" "$pkg/usr/share/bug" "$pkg/usr/share/lintian"

  # distro: the packages as installed, alternatives replayed, ld cache made.
  cp -al "$pkg" "$dir.tmp/distro"
  replay_alternatives "$dir.tmp/distro" "$dir.tmp/nvidia-alternative.control/postinst"
  ld_conf "$dir.tmp/distro" "/usr/local/lib/$triplet" "/lib/$triplet" "/usr/lib/$triplet"

  # gke: /usr/local/nvidia, its lib64 in the host's ld cache.
  local gke="$dir.tmp/gke/usr/local/nvidia"
  flat "$pkg" "$gke/lib64" "$gke/bin" "$gke/firmware" "$v"
  ld_conf "$dir.tmp/gke" /usr/local/nvidia/lib64

  # cos: /home/kubernetes/bin/nvidia, in no ld cache.
  local cos="$dir.tmp/cos/home/kubernetes/bin/nvidia"
  flat "$pkg" "$cos/lib64" "$cos/bin" "$cos/firmware" "$v"

  # operator: a whole driver root at /run/nvidia/driver with its own ld cache.
  local op="$dir.tmp/operator/run/nvidia/driver"
  flat "$pkg" "$op/usr/lib/$triplet" "$op/usr/bin" "$op/lib/firmware" "$v"
  ld_conf "$op" "/usr/local/lib/$triplet" "/lib/$triplet" "/usr/lib/$triplet"

  rm -rf "$dir" && mv "$dir.tmp" "$dir"
  for p in pkg distro gke cos operator; do echo "$name/$p $v @/$name/$p"; done >> "$ready.tmp"
}

rm -f "$ready.tmp"
build_branch 535 bookworm 535.
build_branch 550 trixie 550.

# CUDA 11.8's runtime and LLVM's OpenMP, for the hook's tests; glibc, for images whose programs
# load libcuda; bullseye's glibc 2.31 with its programs (libc-bin), the oldest glibc reachable
# here, for the hook's old-glibc test.
for item in "cudart11 libcudart11.0 bookworm 11." "libomp5 libomp5-14 bookworm 1:14." \
  "libc6 libc6 bookworm 2.36" "libc6-2.31 libc6 bullseye 2.31" "libc6-2.31 libc-bin bullseye 2.31"; do
  read -r name package suite prefix <<<"$item"
  v="$(pick "$package" "$suite" "$prefix")"
  [ -n "$v" ] || { echo "fetch.sh: no $package $prefix* in $suite" >&2; exit 1; }
  # Items of several packages: emptied before the first.
  if ! grep -q "^$name " "$ready.tmp"; then rm -rf "$cache/$name" && mkdir -p "$cache/$name"; fi
  unpack "$package" "$v" "$cache/$name"
  grep -q "^$name " "$ready.tmp" || echo "$name $v @/$name" >> "$ready.tmp"
done

publish_ready
