# Sourced by bin/gradtap and bin/test: make sure the project's virtualenv exists and
# holds exactly the pinned dependencies, creating or refreshing it when they change.
set -euo pipefail
GRADTAP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRADTAP_VENV:-$GRADTAP_ROOT/.venv}"

find_python() {
    for py in python3.11 python3; do
        if command -v "$py" >/dev/null 2>&1 &&
           "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            command -v "$py"; return 0
        fi
    done
    echo "gradtap needs Python 3.11 on PATH (python3.11 or python3); none was found" >&2
    return 1
}

stamp_of() { cat "$GRADTAP_ROOT/requirements.lock" "$GRADTAP_ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1; }

ensure_venv() {
    local want; want="$(stamp_of)"
    if [[ -x "$VENV/bin/python" && "$(cat "$VENV/.gradtap-stamp" 2>/dev/null)" == "$want" ]]; then
        return 0
    fi
    echo "gradtap: preparing virtualenv at $VENV (pinned dependencies, once)" >&2
    [[ -x "$VENV/bin/python" ]] || "$(find_python)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    # pip would byte-compile what it installs on one core; compileall does it on every core
    # (2-core AMD EPYC: the virtualenv in 95-102 s against 117 s). It exits 1 on the files no
    # Python 3.11 compiles (torch's py312_intrinsics.py, as pip also skips them).
    "$VENV/bin/python" -m pip install --quiet --no-compile -r "$GRADTAP_ROOT/requirements.lock" >&2
    local site; site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$VENV/bin/python" -m compileall -qq -j 0 "$site" >&2 || true
    "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$GRADTAP_ROOT" >&2
    echo "$want" > "$VENV/.gradtap-stamp"
}
ensure_venv
