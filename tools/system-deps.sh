#!/usr/bin/env bash
# Installs the Debian programs the tests run, when missing: the real Prometheus,
# promtool, Alertmanager and amtool (monitoring integration tests), systemd-analyze
# (systemd unit tests), iproute2 (the partition test's network namespaces) and chromium
# (the status page test, headless). Through apt when run as root or with password-less
# sudo; otherwise one line saying what to install and why, and the tests that need a
# missing program fail naming it. The tests start their own instances on loopback ports,
# so whether the packages' daemons start does not matter.
set -euo pipefail

missing=()
have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/bin/$1" || -x "/usr/sbin/$1" ]]; }
{ have prometheus && have promtool; } || missing+=(prometheus)
{ have prometheus-alertmanager && have amtool; } || missing+=(prometheus-alertmanager)
have systemd-analyze || missing+=(systemd)
have ip || missing+=(iproute2)
{ have chromium || have chromium-headless-shell; } || missing+=(chromium)
(( ${#missing[@]} )) || exit 0

why="the monitoring, systemd-unit, partition and status-page tests run them"
sudo=()
if (( EUID != 0 )); then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "note: install ${missing[*]} (Debian packages: apt-get install ${missing[*]}); $why" >&2
        exit 0
    fi
fi
if ! command -v apt-get >/dev/null; then
    echo "note: install ${missing[*]} (Debian package names); $why" >&2
    exit 0
fi
echo "== installing ${missing[*]} with apt ($why)"
log=$(mktemp)
if ! { "${sudo[@]}" apt-get update -qq &&
       "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "error: could not install ${missing[*]} with apt; $why" >&2
    exit 1
fi
rm -f "$log"
