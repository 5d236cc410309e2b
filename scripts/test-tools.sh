#!/bin/sh
# The programs the suite's see-it tests run beside the daemon, as a person would: tmux (meshd-mps top
# in a real terminal, tests/serve/test_top.py) and Prometheus with promtool (the dashboard's queries and the
# alerts, tests/serve/test_prometheus.py).  Where one is missing and this is root with apt-get (CI: a fresh
# Debian-like machine), Debian's packages are installed; else it says why and exits 3 (the tests then
# skip, saying so).  Started by `make test` in the background as the suite starts, and by the tests'
# set-up (tests/rigs/tools.py) where they still miss one: one install at a time (flock), the second
# finds the programs there.  Services the packages bring are not started (policy-rc.d, where none is).
set -eu
missing() {
  want=""
  command -v tmux >/dev/null 2>&1 || want="$want tmux"
  { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || want="$want prometheus"
  echo "$want"
}
[ -z "$(missing)" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || ! command -v flock >/dev/null 2>&1; then
  echo "test-tools:$(missing) not installed, and this is not root with apt-get and flock to install them" >&2
  exit 3
fi
exec 9>/tmp/meshd-mps-test-tools.lock
flock 9
want=$(missing)
[ -z "$want" ] && exit 0
export DEBIAN_FRONTEND=noninteractive
policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then  # the prometheus package would start its service (and leave it running)
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=1
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
start=$(date +%s)
# shellcheck disable=SC2086  # $want: the package names, one word each
if ! apt-get install -y -q --no-install-recommends $want >/tmp/meshd-mps-test-tools.log 2>&1; then
  apt-get update -q >>/tmp/meshd-mps-test-tools.log 2>&1  # a fresh machine's package lists
  apt-get install -y -q --no-install-recommends $want >>/tmp/meshd-mps-test-tools.log 2>&1 || {
    tail -20 /tmp/meshd-mps-test-tools.log >&2; exit 1; }
fi
echo "test-tools: installed$want in $(( $(date +%s) - start )) s${policy:+ (their services not started)}" >&2
