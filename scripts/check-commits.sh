#!/usr/bin/env bash
# Checks commit messages as CONTRIBUTING.md asks: a subject of at most 72 characters with an area
# prefix (`core/dra: ...`, `nri-plugin: ...`), in the imperative, no trailing period; when there is
# a body, a blank line after the subject. Exits 1 naming each commit that does not.
#
#   scripts/check-commits.sh [RANGE]   (default: the commits after the rule came in)
#
# As a hook, in .git/hooks/commit-msg:  bash scripts/check-commits.sh --message "$1"
set -euo pipefail
cd "$(dirname "$0")/.."
# The last commit before the rule: older subjects are history, left as they are.
base=fc5489c
check() { # <what> <message file>
  local what="$1" file="$2" subject second problems=()
  subject="$(head -n1 "$file")"
  second="$(sed -n 2p "$file")"
  [ "${#subject}" -le 72 ] || problems+=("subject is ${#subject} characters (at most 72)")
  [[ "$subject" =~ ^[a-z0-9][a-z0-9/._-]*(,\ [a-z0-9][a-z0-9/._-]*)*:\ [^\ ] ]] ||
    problems+=("no area prefix (\`core/dra: ...\`, lower case, then \": \")")
  [[ "$subject" != *. ]] || problems+=("subject ends with a period")
  local verb="${subject#*: }"; verb="${verb%% *}"
  [[ ! "$verb" =~ ^[A-Za-z]+(ed|ing)$ ]] || [[ "$verb" =~ ^(need|feed|embed|seed|shed|speed|bring|string)$ ]] ||
    problems+=("\"$verb\": write the subject in the imperative (\`add\`, not \`added\`)")
  [ -z "$second" ] || problems+=("no blank line between subject and body")
  if [ "${#problems[@]}" -gt 0 ]; then
    printf '%s: %s\n' "$what" "$subject" >&2
    printf '  - %s\n' "${problems[@]}" >&2
    return 1
  fi
}
if [ "${1:-}" = "--message" ]; then
  check "this commit" "${2:?--message needs the message file}"
  exit
fi
range="${1:-$base..HEAD}"
if ! git rev-parse --quiet --verify "${range%%..*}^{commit}" >/dev/null; then
  echo "check-commits: ${range%%..*} is not in this clone (a shallow checkout?): nothing checked" >&2
  exit 0
fi
bad=0 n=0 msg="$(mktemp)"
trap 'rm -f "$msg"' EXIT
for c in $(git rev-list --no-merges "$range"); do
  n=$((n + 1))
  git log -1 --format=%B "$c" > "$msg"
  check "$(git rev-parse --short "$c")" "$msg" || bad=$((bad + 1))
done
if [ "$bad" -gt 0 ]; then
  echo "check-commits: $bad of $n commit(s) in $range need a better message (CONTRIBUTING.md)" >&2
  exit 1
fi
echo "check-commits: $n commit(s) in $range, each message as CONTRIBUTING.md asks"
