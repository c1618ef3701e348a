#!/usr/bin/env bash
# Fresh-machine checks, in a new venv that holds only what each step installs:
#
#   1. `pip install .` (runtime dependencies only) brings in neither numpy nor matplotlib,
#      `import dtensor_moe` works from outside the checkout, on the installed package, and the
#      demo (short setting) trains and passes parity there, without numpy;
#   2. the README's first command, exactly as written, with a short setting appended to its
#      demo, installs the plot extra, trains, passes the parity check and writes
#      moe_demo_out/metrics.json and moe_demo_out/training.png.
#
# torch==2.13.0 is installed first in both, so that pip takes the local CPU wheel. The venv and
# a copy of the checkout live in one temporary directory, removed on exit.
# Usage: .ci/fresh_venv.sh   (.ci/run calls it before the test suite; PYTHON picks the
# interpreter that creates the venv, default `python`)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The demo's short setting: one layer, 8 steps of 4 x 16 tokens, default layout (4 processes).
steps=8
short=(--steps "$steps" --batch 4 --seq-len 16 --layers 1 --dim 32)

step() { printf 'fresh venv: %s (%d s so far)\n' "$1" "$SECONDS"; }

# Copy the checkout (tracked files, plus untracked ones git does not ignore). pip builds in the
# source tree, and a stale build/ left in the checkout could otherwise end up in the wheel.
mkdir "$tmp/src"
(
    cd "$repo"
    git ls-files -z --cached --others --exclude-standard |
        while IFS= read -r -d '' f; do if [[ -e $f ]]; then printf '%s\0' "$f"; fi; done |
        tar --null -T - -cf -
) | tar -C "$tmp/src" -xf -

"${PYTHON:-python}" -m venv "$tmp/venv"
export VIRTUAL_ENV="$tmp/venv" PATH="$tmp/venv/bin:$PATH" PIP_QUIET=1
unset PYTHONPATH PYTHONHOME
hash -r
cd "$tmp"  # outside the checkout: imports resolve to the installed package
python -m pip install "torch==2.13.0"
python -m pip install "$tmp/src"
step "pip install . done"

python - <<'EOF'
import importlib.util
import sys

extra = [name for name in ("numpy", "matplotlib") if importlib.util.find_spec(name) is not None]
if extra:
    sys.exit(f"fresh venv: `pip install .` installed {extra}; the runtime deps must be torch only")
EOF
python -m pip check >/dev/null
# torch warns "Failed to initialize NumPy" without numpy; that warning is torch's, so the
# import's stderr is shown only when the import fails.
if ! python -c '
import sys
import dtensor_moe
assert dtensor_moe.__file__.startswith(sys.prefix), dtensor_moe.__file__
' 2>"$tmp/import.err"; then
    cat "$tmp/import.err" >&2
    exit 1
fi
step "import dtensor_moe without numpy or matplotlib ok"

# Still runtime deps only: the demo's 4 gloo processes (FSDP2, EP, TP/SP, fused AdamW, the
# single-process parity rerun) need no numpy either (Note [Object collectives without numpy]).
# Without matplotlib it writes metrics.json only; stderr is shown when the run fails.
if ! python -m dtensor_moe.demo "${short[@]}" --out "$tmp/no_numpy_out" >"$tmp/no_numpy.log" 2>&1 \
    || ! grep -q -- "-> OK" "$tmp/no_numpy.log" || [[ ! -f $tmp/no_numpy_out/metrics.json ]]; then
    cat "$tmp/no_numpy.log" >&2
    echo "fresh venv: the demo failed with the runtime dependencies only (no numpy)" >&2
    exit 1
fi
step "demo with the runtime dependencies only (no numpy) passed parity"

readme_cmd="$(python - "$repo/README.md" <<'EOF'
import re
import sys

block = re.search(r"```bash\n(.*?)```", open(sys.argv[1]).read(), re.S)
command = block.group(1).strip() if block else ""
if "\n" in command or not command.endswith("python -m dtensor_moe.demo"):
    sys.exit(f"README.md: the first bash block must be one command ending in the demo: {command!r}")
print(command)
EOF
)"
cd "$tmp/src"
if ! eval "$readme_cmd ${short[*]}" >"$tmp/demo.log" 2>&1; then
    cat "$tmp/demo.log" >&2
    echo "fresh venv: the README's first command failed: $readme_cmd ${short[*]}" >&2
    exit 1
fi
python - "$tmp/demo.log" "$steps" <<'EOF'
import json
import sys

from pathlib import Path

log, steps = Path(sys.argv[1]).read_text(), int(sys.argv[2])
metrics, png = Path("moe_demo_out/metrics.json"), Path("moe_demo_out/training.png")
problems = []
if not metrics.is_file():
    problems.append(f"{metrics} was not written")
else:
    summary = json.loads(metrics.read_text())["summary"]
    if not summary["parity_ok"] or "-> OK" not in log:
        problems.append("the parity check did not pass")
    if summary["compared_steps"] != steps:
        problems.append(f"parity compared {summary['compared_steps']} of {steps} steps")
if not png.is_file():
    problems.append(f"{png} was not written (does the command install the plot extra?)")
elif not png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n"):
    problems.append(f"{png} is not a PNG image")
if problems:
    sys.exit(log + "\nfresh venv: " + "; ".join(problems))
EOF
step "README's first command + short setting passed parity, wrote metrics.json and training.png"
