#!/usr/bin/env bash
# Benchmarks 1 (no-generation window per update vs the engine's own reload and a restart) and 2
# (tokens/s retained under an update every 10 s, default `keep` drain) on one NVIDIA GPU, with the
# CUDA builds of vLLM and SGLang, in about ten minutes once the environments exist:
#
#     bash benchmarks/gpu_smoke.sh
#
# It builds two virtual environments under ${DELTA_SWAP_CACHE:-~/.cache/delta-swap} (vLLM 0.32 and
# SGLang 0.5.23 from PyPI, CUDA wheels, which need a driver for CUDA 13; set WHEELS=DIR to install
# from a folder of wheels instead of the network: it must also hold setuptools and wheel), then
# runs the two benchmarks on small models and prints their tables. Output goes to
# ${OUT:-gpu-smoke-output}/ (JSON and PNG), not to docs/.
#
# On a machine without an NVIDIA GPU, or with a driver too old for these wheels, it says so and
# exits without measuring anything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_smoke: SKIPPED: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing was measured."
  exit 0
fi
nvidia-smi -L
cuda=$(nvidia-smi | grep -o 'CUDA Version: [0-9]*' | grep -o '[0-9]*$' || echo 0)
if [ "${cuda:-0}" -lt 13 ] && [ -z "${FORCE:-}" ]; then
  echo "gpu_smoke: SKIPPED: the driver supports CUDA ${cuda:-?}; the PyPI builds of vLLM 0.32 and SGLang 0.5.23"
  echo "need CUDA 13 (FORCE=1 tries anyway); nothing was measured."
  exit 0
fi
py=${PYTHON:-python3}
cache=${DELTA_SWAP_CACHE:-$HOME/.cache/delta-swap}
out=$(realpath -m "${OUT:-gpu-smoke-output}")
mkdir -p "$cache" "$out"
pip_src=()
if [ -n "${WHEELS:-}" ]; then pip_src=(--no-index --find-links "$WHEELS"); fi
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
# every update is staged in shared memory (the changed tensors, i.e. most of the model)
shm_mb=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
if [ -z "${DELTA_SWAP_STAGING_DIR:-}" ] && [ "${shm_mb:-0}" -lt 4096 ]; then
  echo "gpu_smoke: /dev/shm has ${shm_mb:-0} MB free; staging updates in $cache/staging instead"
  export DELTA_SWAP_STAGING_DIR="$cache/staging"
  mkdir -p "$DELTA_SWAP_STAGING_DIR"
fi

build() {  # build VENV PACKAGE...: a venv with the packages, this project (editable) and the bench tools
  local venv=$1; shift
  if [ ! -f "$venv/.complete" ]; then
    rm -rf "$venv" && "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "${pip_src[@]}" "$@" matplotlib openai
    "$venv/bin/pip" install -q "${pip_src[@]}" -e "$root"
    touch "$venv/.complete"
  fi
  "$venv/bin/pip" install -q "${pip_src[@]}" --no-deps -e "$root" >/dev/null
}
build "$cache/gpu-vllm" "vllm==0.32.0" "transformers" "tokenizers" "safetensors"
build "$cache/gpu-sglang" "sglang==0.5.23"

export DELTA_SWAP_DEVICE=cuda DELTA_SWAP_SGLANG_PYTHON="$cache/gpu-sglang/bin/python"
cd "$root"
set -x
# vLLM: its default path and the in-place one (changed elements scattered into the CUDA parameters)
"$cache/gpu-vllm/bin/python" -m benchmarks.swap_window --engines vllm --sizes 100M 350M --updates 3 \
  --swap-paths auto inplace --json "$out/swap_window_vllm.json" --plot "$out/swap_window_vllm.png"
"$cache/gpu-vllm/bin/python" -m benchmarks.swap_window --engines sglang --sizes 100M 350M --updates 3 \
  --json "$out/swap_window_sglang.json" --plot "$out/swap_window_sglang.png"
"$cache/gpu-vllm/bin/python" -m benchmarks.throughput_under_updates --size 350M --modes keep --seconds 60 \
  --rounds 2 --streams 8 --json "$out/throughput_under_updates.json" --plot "$out/throughput_under_updates.png"
