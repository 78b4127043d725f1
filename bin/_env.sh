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
    "$VENV/bin/python" -m pip install --quiet -r "$GRADTAP_ROOT/requirements.lock" >&2
    "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$GRADTAP_ROOT" >&2
    echo "$want" > "$VENV/.gradtap-stamp"
}
ensure_venv
