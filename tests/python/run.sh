#!/usr/bin/env bash
# The Python bindings (python/): build the abi3 wheel with maturin, install it in a fresh
# venv with pytest and numpy, run tests/python there; then the differential test with
# Dynamo 1.6.1's class (the compatibility venv of tests/compat/ensure-venv.sh, its
# site-packages put on the path) required to run, not skip.
# Downloads are cached: the build venv under ~/.cache/kvr/py-build-venv (stamped with
# requirements.txt's checksum), pip's own cache for the fresh venv's packages.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
cache="${HOME}/.cache/kvr"
base_python="${KVR_PY_BASE_PYTHON:-python3}"
req="${here}/requirements.txt"
target="${CARGO_TARGET_DIR:-${root}/target}"
export CARGO_TARGET_DIR="${target}"
log() { echo "tests/python: $*" >&2; }

# The build venv (maturin), once per requirements.txt.
build_venv="${cache}/py-build-venv"
want="$(sha256sum "${req}" | cut -d' ' -f1)"
if [[ ! -x "${build_venv}/bin/maturin" || "$(cat "${build_venv}/.kvr-stamp" 2>/dev/null)" != "${want}" ]]; then
    log "creating ${build_venv}"
    rm -rf "${build_venv}"
    "${base_python}" -m venv "${build_venv}"
    "${build_venv}/bin/pip" install -q --disable-pip-version-check "$(grep '^maturin==' "${req}")"
    echo "${want}" > "${build_venv}/.kvr-stamp"
fi

log "maturin build"
wheels="${target}/wheels"
rm -f "${wheels}"/kvr-*.whl
(cd "${root}/python" && "${build_venv}/bin/maturin" build --release --locked \
    -i "${base_python}" --out "${wheels}" >&2)
wheel="$(ls "${wheels}"/kvr-*-abi3-*.whl)"

venv="${target}/python-test-venv"
log "fresh venv ${venv} with $(basename "${wheel}")"
rm -rf "${venv}"
"${base_python}" -m venv "${venv}"
"${venv}/bin/pip" install -q --disable-pip-version-check \
    "$(grep '^pytest==' "${req}")" "$(grep '^numpy==' "${req}" | cut -d' ' -f1)" "${wheel}"

cd "${here}"
log "pytest (the wheel alone)"
"${venv}/bin/python" -m pytest -q -p no:cacheprovider --ignore=test_differential.py .

log "pytest: differential test against Dynamo 1.6.1's SelectionService"
compat_py="$(bash "${root}/tests/compat/ensure-venv.sh" | tail -n1)"
site="$("${compat_py}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [[ "$("${compat_py}" -c 'import sys; print(sys.version_info[:2])')" != \
      "$("${venv}/bin/python" -c 'import sys; print(sys.version_info[:2])')" ]]; then
    echo "tests/python: the compatibility venv's Python differs from ${base_python}" >&2
    exit 1
fi
PYTHONPATH="${site}" KVR_REQUIRE_DYNAMO=1 \
    "${venv}/bin/python" -m pytest -q -p no:cacheprovider test_differential.py
