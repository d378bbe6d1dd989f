#!/usr/bin/env bash
# The Python per-call benchmark (bench_selection.py): the wheel from tests/python/run.sh's
# build (target/wheels, built here if missing) installed in a venv beside the compat venv's
# Dynamo 1.6.1 (its site-packages on the path). Arguments go to bench_selection.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
target="${CARGO_TARGET_DIR:-${root}/target}"
venv="${target}/python-test-venv"
if [[ ! -x "${venv}/bin/python" ]] || ! "${venv}/bin/python" -c "import kvr" 2>/dev/null; then
    echo "benches/python: building and installing the wheel (tests/python/run.sh)" >&2
    bash "${root}/tests/python/run.sh"
fi
compat_py="$(bash "${root}/tests/compat/ensure-venv.sh" | tail -n1)"
site="$("${compat_py}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PYTHONPATH="${site}" "${venv}/bin/python" "${here}/bench_selection.py" "$@"
