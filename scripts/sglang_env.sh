#!/usr/bin/env bash
# Create (or reuse) the cached SGLang CPU environment used by tests/test_sglang_engine.py; print its path.
#
# SGLang's own metadata pins CUDA torch and CUDA-only kernel packages, and PyPI has no CPU build of
# its kernels, so this environment is assembled by hand (docs/SGLANG.md explains every step):
#   1. torch 2.13.0 CPU and SGLang's non-CUDA dependencies (requirements/sglang-cpu.txt) + the core's;
#   2. sglang and torchvision with --no-deps (the "#nodeps" lines of that file);
#   3. torchvision's registration of its compiled ops guarded: the PyPI wheel is a CUDA build whose
#      ops cannot load next to CPU torch, and without the guard `import torchvision` fails;
#   4. tests/sglang_cpu_shim: a stand-in `sgl_kernel` module, a CPU TEST SHIM with no kernels whose
#      functions raise (and log) if called; it only lets SGLang's imports succeed;
#   5. this project, editable and --no-deps, so its `sglang.srt.plugins` entry point is registered.
# It lives outside the checkout, ${DELTA_SWAP_CACHE:-~/.cache/delta-swap}/sglang-venv-<hash>, keyed by
# everything above and the Python version, so it is rebuilt only when one of them changes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${DELTA_SWAP_CACHE:-$HOME/.cache/delta-swap}
py=${PYTHON:-python3}
shim="$root/tests/sglang_cpu_shim"
key=$(cat "$root/requirements/sglang-cpu.txt" "$root/requirements/core.txt" "$root/scripts/sglang_env.sh" \
  "$shim/pyproject.toml" "$shim"/sgl_kernel/*.py <("$py" -V) | sha256sum | cut -c1-16)
venv="$cache/sglang-venv-$key"
. "$root/scripts/env_lock.sh" "$venv"
if [ ! -f "$venv/.complete" ]; then
  echo "delta-swap: building the SGLang CPU environment in $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$root/requirements/sglang-cpu.txt" -r "$root/requirements/core.txt" >&2
  # shellcheck disable=SC2046
  "$venv/bin/pip" install -q --no-deps $(sed -n 's/^#nodeps //p' "$root/requirements/sglang-cpu.txt") >&2
  "$venv/bin/python" - <<'EOF'
# Guard torchvision's op registrations (step 3): register them only if its C ops loaded.
import importlib.util, pathlib
init = pathlib.Path(importlib.util.find_spec("torchvision").origin)
text = init.read_text()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = ("# delta-swap CPU guard: this CUDA wheel's C ops cannot load next to CPU torch; register their\n"
       "# fake/autograd kernels only when they did load.\n"
       "if extension._has_ops():\n"
       "    from torchvision import _autograd_registrations, _meta_registrations  # usort:skip\n"
       "from torchvision import (\n")
if text.count(old) != 1:
    raise SystemExit(f"delta-swap: {init} does not look like torchvision 0.28's; cannot apply the CPU guard")
init.write_text(text.replace(old, new))
import torchvision  # noqa: F401  (fails here, at build time, if the guard is not enough)
EOF
  "$venv/bin/pip" install -q --no-deps "$shim" >&2
  rm -rf "$shim/build" "$shim"/*.egg-info
  touch "$venv/.complete"
fi
# Point the editable install at this checkout (CI clones elsewhere); dependencies are already there.
"$venv/bin/pip" install -q --no-deps -e "$root" >&2
echo "$venv"
