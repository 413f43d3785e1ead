#!/usr/bin/env bash
# Lint, format check, type check and spell check in the cached environment, stopping at the first
# failure. With arguments, only the named checks run (e.g. `scripts/check.sh mypy`, as the
# pre-commit hook does); the settings of each tool are in pyproject.toml.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/env.sh")
bash "$root/scripts/import_root.sh" >/dev/null  # mypy reads delta_swap from .import-root
cd "$root"
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(lint format mypy codespell)
for check in "${checks[@]}"; do
  echo "check: $check" >&2
  case "$check" in
    lint) "$venv/bin/ruff" check . ;;
    format) "$venv/bin/ruff" format --check . ;;
    mypy) "$venv/bin/mypy" ;;
    codespell) "$venv/bin/codespell" ;;
    *) echo "check: unknown check $check (lint, format, mypy, codespell)" >&2; exit 2 ;;
  esac
done
