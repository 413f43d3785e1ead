#!/usr/bin/env bash
# Install everything (cached environment) and run the main demo: a tiny model published to a
# local file:// store step by step, pulled back and verified, and hot-swapped into a live engine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
cd "$root"
exec "$venv/bin/python" -m examples.demo "$@"
