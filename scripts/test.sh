#!/usr/bin/env bash
# Run the whole test suite (core, CLI and the real-engine tests) in the cached environment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
# This checkout's code first on the path, whatever checkout last pointed the shared environment at.
export PYTHONPATH="$(bash "$root/scripts/import_root.sh")${PYTHONPATH:+:$PYTHONPATH}"
# The fleet smoke test runs a stock nginx as each region's cache (Debian's nginx-light is enough).
if ! command -v nginx >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) >&2 \
    || echo "delta-swap: could not install nginx; the fleet smoke test will be skipped" >&2
fi
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs --durations=25 "$@"
