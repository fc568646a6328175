# Sourced by the fetch scripts: a locked cache folder with a ready file, and Debian's apt
# pointed at a private configuration in it, so packages are looked up and downloaded without
# touching the system's apt configuration and nothing is installed.
#
#   open_cache DIR READY_NAME REFRESH
#       makes and locks DIR (sets cache, ready); when READY_NAME exists there and REFRESH is
#       empty, prints it (its `@` replaced by the cache's path) and exits: nothing to fetch
#   private_apt DIR "deb http://deb.debian.org/debian SUITE COMPONENTS" ...
#       sets apt_opts (for apt-get / apt-cache) and apt_dir, and updates the package lists
#   pick PACKAGE SUITE PREFIX
#       prints the newest version of PACKAGE in SUITE that starts with PREFIX
#   extract NAME PACKAGE VERSION
#       downloads PACKAGE=VERSION and unpacks it (dpkg -x) at $cache/NAME, replacing it whole
#   publish_ready
#       moves $ready.tmp to $ready, prints it, and drops the downloaded packages and lists:
#       what was unpacked is all a ready cache uses (a CI disk is often nearly full)

open_cache() {
  cache="$1"
  mkdir -p "$cache"
  cache="$(cd "$cache" && pwd)"
  exec 9>"$cache/.lock"
  flock 9
  # The ready file names paths relative to the cache (`@`), so a copied cache works anywhere.
  ready="$cache/$2"
  if [ -f "$ready" ] && [ -z "$3" ]; then
    sed "s|@|$cache|" "$ready"
    exit 0
  fi
}

private_apt() {
  apt_dir="$1"
  shift
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
  printf '%s\n' "$@" > "$apt_dir/sources.list"
  apt_opts=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir/cache"
    -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=root"
  )
  apt-get "${apt_opts[@]}" -qq update >/dev/null
}

pick() {
  apt-cache "${apt_opts[@]}" madison "$1" | awk -F'|' -v suite="$2" -v prefix="$3" '
    { gsub(/ /, "", $2); if (index($3, " " suite "/") && index($2, prefix) == 1) print $2 }' |
    sort -V | tail -n 1
}

extract() {
  local dest="$cache/$1"
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" -qq download "$2=$3" >/dev/null)
  dpkg -x "$apt_dir/debs/$(ls "$apt_dir/debs" | grep -F "$2_" | grep -F "$(echo "$3" | sed 's/:/%3a/')" | head -n 1)" "$dest.tmp"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}

publish_ready() {
  mv "$ready.tmp" "$ready"
  rm -rf "$apt_dir/debs" "$apt_dir/lists"
  sed "s|@|$cache|" "$ready"
}
