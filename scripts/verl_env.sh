#!/usr/bin/env bash
# Create (or reuse) the cached verl trainer environment used by tests/test_verl_engine.py; print its path.
#
# verl 0.9.1 pins transformers below 5.11, which vLLM 0.32's environment is above, so verl gets its
# own environment, layered on the project's (scripts/env.sh): a venv whose own site-packages hold
# verl and what it pins (requirements/verl.txt), and which then falls back on the project's
# environment (torch, numpy, the core's packages) through a .pth file. It lives outside the
# checkout, ${DELTA_SWAP_CACHE:-~/.cache/delta-swap}/verl-venv-<hash>, keyed by that file, the base
# environment and the Python version, so it is rebuilt only when one of them changes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${DELTA_SWAP_CACHE:-$HOME/.cache/delta-swap}
base=$(bash "$root/scripts/env.sh")
py="$base/bin/python"
key=$(cat "$root/requirements/verl.txt" "$root/scripts/verl_env.sh" <(echo "$base") <("$py" -V) | sha256sum | cut -c1-16)
venv="$cache/verl-venv-$key"
. "$root/scripts/env_lock.sh" "$venv"
if [ ! -f "$venv/.complete" ]; then
  echo "delta-swap: building the verl environment in $venv (a minute or two, once)" >&2
  rm -rf "$venv"
  "$py" -m venv --without-pip "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not a bare path: the base's own .pth files (this project, editable) count too.
  echo "import site; site.addsitedir('$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
    >"$site/delta_swap_base_env.pth"
  # The base environment's pip installs into this one: its own packages shadow the base's. pip
  # would list vLLM's pins that verl's transformers breaks; vLLM never runs from here.
  "$py" -m pip --python "$venv/bin/python" install -q --no-warn-conflicts -r "$root/requirements/verl.txt" >&2
  touch "$venv/.complete"
fi
echo "$venv"
