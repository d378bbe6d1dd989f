#!/usr/bin/env bash
# Creates (once, then reuses) the compatibility harness's Python environment:
#   - a venv at ${KVR_COMPAT_VENV:-$HOME/.cache/kvr/compat-venv} with the pinned
#     packages of requirements.txt (Dynamo 1.6.1, pyzmq, msgspec);
#   - vLLM 0.33.0's real KV-event publisher, vllm/distributed/kv_events.py,
#     extracted from the vLLM wheel (downloaded once, without dependencies, into
#     $HOME/.cache/kvr/wheels) into ${KVR_COMPAT_VLLM_DIR:-$HOME/.cache/kvr/vllm-0.33.0};
#   - vLLM 0.34.0's, likewise, into ${KVR_COMPAT_VLLM034_DIR:-$HOME/.cache/kvr/vllm-0.34.0}
#     (tests/recovery runs its connector shapes against both vLLM versions);
#   - SGLang 0.5.23's real KV-event publisher, sglang/srt/disaggregation/kv_events.py,
#     likewise from the SGLang wheel into
#     ${KVR_COMPAT_SGLANG_DIR:-$HOME/.cache/kvr/sglang-0.5.23} (tests/recovery drives it).
# Idempotent: a stamp file records the requirements' checksum; a matching stamp
# skips pip entirely. The last stdout line is the venv's python path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${HOME}/.cache/kvr"
venv="${KVR_COMPAT_VENV:-${cache}/compat-venv}"
vllm_dir="${KVR_COMPAT_VLLM_DIR:-${cache}/vllm-0.33.0}"
vllm034_dir="${KVR_COMPAT_VLLM034_DIR:-${cache}/vllm-0.34.0}"
sglang_dir="${KVR_COMPAT_SGLANG_DIR:-${cache}/sglang-0.5.23}"
wheels="${cache}/wheels"
base_python="${KVR_COMPAT_BASE_PYTHON:-python3}"
req="${here}/requirements.txt"

log() { echo "ensure-venv: $*" >&2; }

mkdir -p "${cache}" "${wheels}"

want="$(sha256sum "${req}" | cut -d' ' -f1)"
stamp="${venv}/.kvr-compat-stamp"
if [[ -x "${venv}/bin/python" && -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    log "venv ${venv} up to date"
else
    log "creating venv ${venv}"
    "${base_python}" -m venv "${venv}"
    "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check -r "${req}" >&2
    echo "${want}" > "${stamp}"
fi

# extract PKG VERSION DEST MODULE: MODULE (a path inside PKG's wheel) into DEST, the wheel
# downloaded once, without dependencies, into ${wheels}.
extract() {
    local pkg="$1" version="$2" dest="$3" module="$4" wheel
    [[ -f "${dest}/${module}" ]] && return 0
    wheel="$(ls "${wheels}/${pkg}-${version}"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "${wheel}" ]]; then
        log "downloading ${pkg}==${version} (no dependencies) into ${wheels}"
        "${venv}/bin/python" -m pip download --quiet --disable-pip-version-check \
            --no-deps "${pkg}==${version}" -d "${wheels}" >&2
        wheel="$(ls "${wheels}/${pkg}-${version}"-*.whl | head -n1)"
    fi
    log "extracting ${module} from $(basename "${wheel}")"
    mkdir -p "${dest}"
    "${venv}/bin/python" - "${wheel}" "${dest}" "${module}" <<'PY'
import sys, zipfile
wheel, dest, module = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extract(module, dest)
PY
}
extract vllm 0.33.0 "${vllm_dir}" vllm/distributed/kv_events.py
extract vllm 0.34.0 "${vllm034_dir}" vllm/distributed/kv_events.py
extract sglang 0.5.23 "${sglang_dir}" sglang/srt/disaggregation/kv_events.py

"${venv}/bin/python" -c "import zmq, msgspec, pydantic, dynamo.llm" >&2
echo "${venv}/bin/python"
