# Sourced by the fetch scripts: Debian's apt, pointed at a private configuration under a cache
# folder, so packages are looked up and downloaded without touching the system's apt
# configuration and nothing is installed.
#
#   private_apt DIR "deb http://deb.debian.org/debian SUITE COMPONENTS" ...
#       sets apt_opts (for apt-get / apt-cache) and apt_dir, and updates the package lists
#   pick PACKAGE SUITE PREFIX
#       prints the newest version of PACKAGE in SUITE that starts with PREFIX

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
