#!/usr/bin/env bash
# Install everything (cached environment) and run the main demo: a GRPO trainer improves a tiny
# policy (generated on the spot) while a live vLLM server with the delta_swap plugin follows a local
# file:// store and hot-swaps every step (examples/rl_loop.py; arguments are passed on, e.g.
# --engine sglang or --engine both).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
# This checkout's code first on the path, whatever checkout last pointed the shared environment at.
export PYTHONPATH="$(bash "$root/scripts/import_root.sh")${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$venv/bin/python" -m examples.rl_loop "$@"
