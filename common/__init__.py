"""delta-swap: publish lossless weight deltas from a trainer, hot-swap them into running engines.

Layers, bottom up: a module imports only from its own layer or those below it (checked by
tests/test_layer_map.py). This is the one map of the package; README.md and docs/ARCHITECTURE.md
point here::

    format   codec/                 the lossless tensor codec behind one facade (codec/__init__):
                                    v2/ writes DSC2 (wire, bitio, encode_kernels, decode_kernels,
                                    parse, encoder, decoder, sign_model, select_apply, jit, samples),
                                    v1 reads DSC1 (old stores), zstd_frames, inputs, memory (the
                                    encoder's sign models kept from one step to the next)
             codec_warm_up          the codec's kernels compiled in a child process at start, then
                                    LLVM's pages given back
             manifest               snapshot manifest, SnapshotKind, Encoding, validation
                                    (docs/FORMAT.md)
             shard_format           the delta shard (.dsd): its magic, which readers check
             store_keys             where every key lives in a store
             safetensors_io         the safetensors file format
             checkpoint_dir         Hugging Face checkpoint folders
             integrations/hf_names  a live transformers model's checkpoint names (tied, fused experts)
             signing                Ed25519 manifest signatures, trusted keys (docs/SECURITY.md)
             dtypes, tensors        dtype names and sizes; HostTensor, StateDict
             checksum, errors       xxh3-128 and SHA-256; the one exception hierarchy
             host_memory            giving memory back (freed heap pages, LLVM once kernels load)
             atomic_file            files replaced whole or not at all (a temp file renamed over)
    stores   stores/                one async Store interface; file://, s3:// (aiobotocore),
                                    http(s):// (httpx, read only); a registry keyed by URL scheme
             retry                  backoff: jitter for stores, the poller's wait after a failed update
    chain    chain                  reading HEAD, manifests and paths through the chain
             freshness              never going back: the newest snapshot a reader verified
             heartbeat              the trainer's signed heartbeat (a frozen HEAD shows as stale)
             rebuild                fetch, check, decode and verify snapshots (large shards streamed)
             commit                 how ranks' parts become a manifest and move HEAD
             head_cache             the publisher's local copy of the last step it published (no
                                    rebuild of the store's head before the next delta)
             publisher              the trainer side: background encode, upload, commit, notify
             retention              deleting snapshots no server needs (PublisherConfig.keep_bases)
    rollout  settings               Settings: every setting of a rollout server
             served_model           what a server runs; snapshots are checked against it
             engine_adapter         the contract an engine adapter implements (EngineAdapter)
             arena                  weight arenas: one flat buffer per dtype, a live and a spare copy
             torch_params           pointing an engine's parameters into an arena
             module_groups          which checkpoint tensors an engine loads into one module
             loader_redirect        loading through a model's own loaders into other tensors
                                    than its live parameters
             undo                   taking a failed swap back, and whether that worked
             inplace                writing only the changed elements into live parameters, with
                                    an undo log (swap_path=inplace)
             fresh_pages            zeroed host tensors on fresh (huge) pages, for shadow builds
             shadow                 building changed modules processed before the pause and
                                    switching them in it (swap_path=shadow)
             param_switch           new tensors of the changed plain parameters built before the
                                    pause, pointed at in it (swap_path=shadow on plain host weights)
             staged_swap            the engine process's half of all three: stage on a thread while
                                    the engine generates, apply in the pause, undo, drop
             staging_files          the adapter's half: the staged files, the wait until every
                                    engine process has staged
             host_copy              the subscriber's copy of the weights in one staging file, decoded
                                    into in place, that engine processes read updates from
             readback               reading back what an engine computes with after a swap (torch)
             verify_budget          when to read a swap back (verify_swaps=auto: within 10% of windows)
             swap                   one update, all or nothing: stage, pause, swap, roll back, resume
             subscriber             poll, plan, fetch, verify, then apply_update
             metrics                Prometheus metrics of the subscriber
    serving  admin_routes           /delta_swap/status, /resync, /notify (FastAPI)
             service                what an engine plugin calls: mount routes, start, stop
             front_ends             several HTTP front ends of one deployment: the first runs the
                                    subscriber, the others answer for it and serve its version
             version_tags           OpenAI responses tagged with the weight version that made them
             testing/               RecordingAdapter, a complete adapter with no engine;
                                    engine_exactness, the suite every engine's tests subclass
    trainers integrations/          HF Trainer / TRL callback (hf_trainer), sharded (FSDP) ranks'
                                    own tensors (sharded), the servers' status (servers), verl's
                                    checkpoint engine (verl), supported versions (versions)
    tools    checkpoint_watch       the checkpoint folders a trainer writes, complete, in step order
             cli                    the ``delta-swap`` command (``watch`` publishes those folders)

Engine adapters live outside the core: ``vllm_delta_plugin`` and ``sglang_delta_plugin`` (each
lists its modules in its own docstring).

The names below are the public API; they are imported on first use, so ``import delta_swap``
stays light (and does not import Prometheus before an engine has configured it).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # trainer side
    "Publisher": "publisher",
    "PublisherConfig": "publisher",
    # rollout side
    "Settings": "settings",
    "DrainPolicy": "settings",
    "Subscriber": "subscriber",
    "EngineAdapter": "engine_adapter",
    "WeightUpdate": "engine_adapter",
    "ServedModel": "served_model",
    "apply_update": "swap",
    "RecordingAdapter": "testing",
    # format and stores
    "Manifest": "manifest",
    "SnapshotKind": "manifest",
    "Encoding": "manifest",
    "Store": "stores",
    "open_store": "stores",
    "register_backend": "stores",
    # errors
    "DeltaSwapError": "errors",
    "ConfigError": "errors",
    "CorruptDataError": "errors",
    "ChecksumMismatchError": "errors",
    "FormatVersionError": "errors",
    "ChainError": "errors",
    "IncompatibleSnapshotError": "errors",
    "StoreError": "errors",
    "NotFoundError": "errors",
    "TransientError": "errors",
    "PublishError": "errors",
    "EngineError": "errors",
    "EngineStateUnknownError": "errors",
    "SwapUndoneError": "errors",
    "SignatureError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'delta_swap' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
