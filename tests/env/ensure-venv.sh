#!/usr/bin/env bash
# Creates (once, then reuses) the suite's Python venv: ${KVR_TEST_VENV:-$HOME/.cache/kvr/test-venv}
# with tests/env/requirements.txt (pyzmq, msgspec), so no package goes into the system
# Python (Debian's refuses: "externally-managed-environment"). A stamp holds the
# requirements' checksum; a matching stamp skips pip. The last stdout line is the venv's
# bin directory: tests/run-all.sh puts it first on PATH, so `python3` in every test (the
# cargo tests' publishers included) is this venv's.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${KVR_TEST_VENV:-${HOME}/.cache/kvr/test-venv}"
base_python="${KVR_BASE_PYTHON:-python3}"
req="${here}/requirements.txt"
want="$(sha256sum "${req}" | cut -d' ' -f1)"
stamp="${venv}/.kvr-test-stamp"
if [[ -x "${venv}/bin/python3" && -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "ensure-venv: ${venv} up to date" >&2
else
    echo "ensure-venv: creating ${venv}" >&2
    rm -rf "${venv}"
    mkdir -p "$(dirname "${venv}")"
    "${base_python}" -m venv "${venv}"
    "${venv}/bin/python3" -m pip install --quiet --disable-pip-version-check -r "${req}" >&2
    echo "${want}" >"${stamp}"
fi
"${venv}/bin/python3" -c "import zmq, msgspec" >&2
echo "${venv}/bin"
