#!/usr/bin/env bash
# Benchmarks 1 (no-generation window per update vs the engine's own reload and a restart) and 2
# (tokens/s retained under an update every 10 s, per drain mode) on one NVIDIA GPU, with the CUDA
# builds of vLLM and SGLang, in a few minutes:
#
#     bash benchmarks/gpu_smoke.sh
#
# It builds two virtual environments under ${DELTA_SWAP_CACHE:-~/.cache/delta-swap} (vLLM 0.32 and
# SGLang 0.5.23 from PyPI, CUDA wheels; set WHEELS=DIR to install from a folder of wheels instead
# of the network), then runs the two benchmarks on small models and prints their tables. Output
# goes to ${OUT:-gpu-smoke-output}/ (JSON and PNG), not to docs/.
#
# On a machine without an NVIDIA GPU it says so and exits without measuring anything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_smoke: SKIPPED: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing was measured."
  exit 0
fi
nvidia-smi -L
py=${PYTHON:-python3}
cache=${DELTA_SWAP_CACHE:-$HOME/.cache/delta-swap}
out=${OUT:-gpu-smoke-output}
mkdir -p "$cache" "$out"
pip_src=()
if [ -n "${WHEELS:-}" ]; then pip_src=(--no-index --find-links "$WHEELS"); fi

build() {  # build VENV PACKAGE...: a venv with the packages, this project (editable) and the bench tools
  local venv=$1; shift
  if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv" && "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "${pip_src[@]}" "$@" matplotlib openai
    "$venv/bin/pip" install -q "${pip_src[@]}" -e "$root"
    touch "$venv/.complete"
  fi
  "$venv/bin/pip" install -q --no-deps -e "$root" >/dev/null
}
build "$cache/gpu-vllm" "vllm==0.32.0" "transformers" "tokenizers" "safetensors"
build "$cache/gpu-sglang" "sglang==0.5.23"

export DELTA_SWAP_DEVICE=cuda DELTA_SWAP_SGLANG_PYTHON="$cache/gpu-sglang/bin/python"
cd "$root"
set -x
"$cache/gpu-vllm/bin/python" -m benchmarks.swap_window --sizes 100M 350M --updates 5 \
  --json "$out/swap_window.json" --plot "$out/swap_window.png"
"$cache/gpu-vllm/bin/python" -m benchmarks.throughput_under_updates --size 350M --seconds 60 --streams 8 \
  --json "$out/throughput_under_updates.json" --plot "$out/throughput_under_updates.png"
