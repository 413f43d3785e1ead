#!/usr/bin/env bash
# Run the whole test suite (core, CLI and the real-engine tests) in the cached environment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
