"""The ``delta-swap`` command: keygen, publish (one checkpoint folder, or every one a trainer writes:
``watch``), pull and inspect snapshot chains.

Every failure a user can cause ends in one line on stderr and a non-zero exit; a traceback is
printed only with ``DELTA_SWAP_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from . import codec, head_cache, store_keys
from .chain import READ_AHEAD, ChainReader, head_step_at
from .checkpoint_dir import PULL_MARKER, install_checkpoint, is_side_file, read_checkpoint_dir, recover_install
from .checkpoint_watch import ready_checkpoints
from .checksum import verify_blob
from .codec_warm_up import WARM_UP_THREAD
from .errors import (
    ChainError,
    CorruptDataError,
    DeltaSwapError,
    IncompatibleSnapshotError,
    NotFoundError,
    RollbackError,
)
from .freshness import Seen, refuse_going_back
from .manifest import Manifest
from .publisher import Publisher, PublisherConfig
from .rebuild import Meter, replay
from .signing import SigningKey, TrustedKeys, generate_keypair, split_paths
from .stores import Store, open_store
from .tensors import StateDict

log = logging.getLogger("delta_swap.cli")


@contextmanager
def _progress(desc: str, total: int | None, enabled: bool) -> Iterator:
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the command leaves no thread behind
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr) as bar:
        yield bar.update


def _trusted(args: argparse.Namespace) -> TrustedKeys | None:
    paths = split_paths(args.trusted_key or os.environ.get("DELTA_SWAP_TRUSTED_KEY"))
    return TrustedKeys.load(paths) if paths else None


# ---------------------------------------------------------------------- keygen


def _cmd_keygen(args: argparse.Namespace) -> int:
    key_path, pub_path = generate_keypair(args.out)
    print(
        f"wrote private key {key_path} (keep it on the trainer) and public key {pub_path} "
        f"(give it to the servers); key id {SigningKey.load(key_path).key_id}"
    )
    return 0


# ---------------------------------------------------------------------- publish


def _cmd_publish(args: argparse.Namespace) -> int:
    state, files = read_checkpoint_dir(args.checkpoint_dir)
    cache = None if args.no_head_cache else str(args.head_cache or head_cache.default_folder())
    # one step per process: a delta loads the kernels as it encodes, a base needs none
    config = _publisher_config(args, head_cache_folder=cache, warm_up=False)
    total = sum(t.nbytes for t in state.values())
    with _progress("publish", total, not args.quiet) as update, Publisher(args.store, config, files, update) as pub:
        snapshot_id = pub.publish(args.step, state, force_base=args.base)
        pub.flush()
        signed = pub.signing_key is not None
    manifest = asyncio.run(_manifest(args.store, snapshot_id))
    print(
        f"published {manifest.snapshot_id} ({manifest.kind}, step {manifest.step}{', signed' if signed else ''}): "
        f"{manifest.payload_bytes} bytes stored for {manifest.model_bytes} model bytes; run {manifest.run_id}"
    )
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    """Publish every checkpoint folder ``args.folder`` gains, in step order, from one process: the
    last step stays in memory, so a delta costs what the library's does (no process start, no
    kernel load, no head to read or cache per step)."""
    signal.signal(signal.SIGTERM, _interrupt)  # stopped by a supervisor: finish like Ctrl-C
    config = _publisher_config(args, head_cache_folder=None, warm_up=True)
    key = args.signing_key or os.environ.get("DELTA_SWAP_SIGNING_KEY")
    trusted = SigningKey.load(key).trusted() if key else None  # the head counts if it is this trainer's
    last = asyncio.run(head_step_at(args.store, trusted))  # a restarted watcher skips what the store holds
    print(f"watching {args.folder} for checkpoints after step {last}", flush=True)
    pub: Publisher | None = None
    unreadable: dict[Path, float] = {}  # folder -> when it last changed, as it failed to read
    try:
        while args.until_step is None or last is None or last < args.until_step:
            for folder in ready_checkpoints(Path(args.folder), last, args.settle_s):
                if unreadable.get(folder.path) == folder.changed:
                    break  # still as it was when it failed: this step and later ones wait
                started = time.monotonic()
                try:
                    state, files = read_checkpoint_dir(folder.path)
                except (DeltaSwapError, OSError) as exc:
                    unreadable[folder.path] = folder.changed
                    print(f"delta-swap watch: {folder.path.name}: {exc}; waiting for it to change", file=sys.stderr)
                    break
                pub = pub or Publisher(args.store, config, files)
                pub.publish(folder.step, state)
                pub.flush()
                manifest = pub.last_manifest
                assert manifest is not None
                last = folder.step
                print(
                    f"published {manifest.snapshot_id} ({manifest.kind}, step {manifest.step}) from {folder.path.name} "
                    f"in {time.monotonic() - started:.2f} s: {manifest.payload_bytes} bytes for {manifest.model_bytes}",
                    flush=True,
                )
                if args.until_step is not None and last >= args.until_step:
                    break
            else:
                time.sleep(args.poll_s)
    finally:
        if pub is not None:
            pub.close()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _publisher_config(args: argparse.Namespace, head_cache_folder: str | None, warm_up: bool) -> PublisherConfig:
    """What ``publish`` and ``watch`` set from their common flags."""
    return PublisherConfig(
        base_every=args.base_every,
        max_delta_fraction=args.max_delta_fraction,
        signing_key=args.signing_key,
        run_id=args.run_id,
        encode_threads=args.encode_threads,
        codec=codec.CodecConfig(level=args.level),
        head_cache=head_cache_folder,
        warm_up=warm_up,
    )


async def _manifest(url: str, snapshot_id: str) -> Manifest:
    store = open_store(url)
    try:
        return await ChainReader(store).manifest(snapshot_id)
    finally:
        await store.close()


# ---------------------------------------------------------------------- pull


def _cmd_pull(args: argparse.Namespace) -> int:
    manifest, nbytes = asyncio.run(_pull(args))
    print(f"pulled {manifest.snapshot_id} (step {manifest.step}) into {args.out}: {nbytes} tensor bytes verified")
    return 0


async def _pull(args: argparse.Namespace) -> tuple[Manifest, int]:
    store = open_store(args.store)
    try:
        reader = ChainReader(store, _trusted(args))
        with _progress("fetch", None, not args.quiet) as update:
            try:
                target = args.snapshot or await reader.latest_id()
            except CorruptDataError as exc:  # HEAD names a snapshot that does not verify
                raise await _name_the_newest_good(reader, None, _Unbuildable(exc), args.max_model_bytes) from None
            if target is None:
                raise ChainError(f"store {store.public_url} has no snapshots")
            recover_install(args.out)  # a pull killed between its renames: its marker counts below
            try:
                if not args.allow_older:  # a target that does not read or verify goes to the search below
                    refuse_going_back(
                        await reader.manifest(target),
                        _earlier_pull(args.out),
                        f"the pull in {args.out}",
                        "pass --allow-older to replace it anyway",
                    )
                path = await reader.path_to(target)
                state = await _rebuild_path(reader, path, update, args.max_model_bytes)
            except _Unbuildable as failed:
                if args.snapshot is not None:
                    raise failed.error from None
                raise await _name_the_newest_good(reader, target, failed, args.max_model_bytes) from None
            except (CorruptDataError, ChainError, NotFoundError) as exc:
                if args.snapshot is not None or isinstance(exc, RollbackError):
                    raise
                raise await _name_the_newest_good(reader, target, _Unbuildable(exc), args.max_model_bytes) from None
        manifest = path[-1]
        files = await _side_files(reader, path)
        marker = {
            "snapshot_id": manifest.snapshot_id,
            "step": manifest.step,
            "run_id": manifest.run_id,
            "store": store.public_url,
            "pulled_at": time.time(),
        }
        with _progress("write", manifest.model_bytes, not args.quiet) as update:
            await asyncio.to_thread(
                install_checkpoint, args.out, state, files, marker, force=args.force, progress=update
            )
        return manifest, manifest.model_bytes
    finally:
        await store.close()


def _earlier_pull(out: str) -> Seen | None:
    """The snapshot an earlier pull wrote into ``out`` (None if ``out`` holds none we can read)."""
    try:
        with open(Path(out) / PULL_MARKER, "rb") as fh:
            return Seen.from_doc(json.loads(fh.read(1 << 16)))
    except (OSError, ValueError, RecursionError):
        return None


class _Unbuildable(Exception):
    """A path that failed to rebuild: the error, the snapshot that failed and the newest one
    before it that did rebuild (decoded and verified) on the way."""

    def __init__(self, error: DeltaSwapError, failed: str | None = None, good: Manifest | None = None) -> None:
        super().__init__(str(error))
        self.error, self.failed, self.good = error, failed, good


async def _rebuild_path(
    reader: ChainReader, path: list[Manifest], progress: Callable[[int], None] | None, max_model_bytes: int | None
) -> StateDict:
    """Replay ``path`` (from a base) one snapshot at a time; raises :class:`_Unbuildable` naming
    the snapshot that failed and the last one that rebuilt."""
    for manifest in path:
        if max_model_bytes is not None and manifest.model_bytes > max_model_bytes:
            raise IncompatibleSnapshotError(
                f"snapshot {manifest.snapshot_id} holds {manifest.model_bytes} bytes of "
                f"tensors, more than the {max_model_bytes} allowed"
            )
    state: StateDict | None = None
    for i, manifest in enumerate(path):
        try:
            state = await replay(reader, [manifest], state, meter=Meter(progress=progress))
        except (CorruptDataError, ChainError, NotFoundError, IncompatibleSnapshotError) as exc:
            raise _Unbuildable(exc, manifest.snapshot_id, path[i - 1] if i else None) from None
    assert state is not None
    return state


#: The pull search downloads at most this many times the model's size (a failed pull's own
#: download does not count: what it rebuilt before the failure is already known to be good).
SEARCH_BYTES_FACTOR = 2


async def _name_the_newest_good(
    reader: ChainReader, target: str | None, failed: _Unbuildable, max_model_bytes: int | None, tries: int = 20
) -> DeltaSwapError:
    """The error to report when ``target`` cannot be rebuilt: it names the newest snapshot that can.

    Candidates are the store's snapshots older than the target (newest first; those a listing
    names but that do not read as manifests are skipped), else the target's own path. The
    snapshot before the one that failed already rebuilt; a newer candidate is rebuilt only when
    its manifests, chain and shard sizes check out and its path avoids every snapshot that failed,
    at most once each, within :data:`SEARCH_BYTES_FACTOR` times the model's size in all."""
    exc = failed.error
    bad = {failed.failed} if failed.failed else set()
    found = failed.good
    try:
        head: Manifest | None = await reader.manifest(target) if target is not None else None
    except DeltaSwapError:
        head = None
    spent = 0
    for manifest in (await _candidates(reader, head.step if head is not None else None))[:tries]:
        budget = SEARCH_BYTES_FACTOR * (head or manifest).model_bytes
        if found is not None and manifest.step <= found.step:
            break
        try:
            path = await reader.path_to(manifest.snapshot_id)
            if bad & {m.snapshot_id for m in path}:
                continue
            await _check_shard_sizes(reader.store, path)
        except DeltaSwapError:
            continue
        cost = sum(m.payload_bytes for m in path)
        if spent + cost > budget:
            continue
        spent += cost
        try:
            await _rebuild_path(reader, path, None, max_model_bytes)
        except _Unbuildable as again:
            bad.add(again.failed or manifest.snapshot_id)
            if again.good is not None and (found is None or again.good.step > found.step):
                found = again.good
            continue
        except DeltaSwapError:
            continue
        found = manifest
        break
    if found is None:
        return type(exc)(f"{exc}; no older snapshot rebuilds either")
    return type(exc)(
        f"{exc}; the newest snapshot that rebuilds is {found.snapshot_id}: pull it with --snapshot {found.snapshot_id}"
    )


async def _candidates(reader: ChainReader, below: int | None) -> list[Manifest]:
    """Snapshots below step ``below`` whose manifests read and verify, newest first; anything
    else a listing names (junk, a link out of the store, a folder) is skipped."""
    try:
        ids = await reader.snapshot_ids()
    except (DeltaSwapError, NotImplementedError):
        return []
    slots = asyncio.Semaphore(READ_AHEAD)

    async def read(snapshot_id: str) -> Manifest | None:
        async with slots:
            try:
                return await reader.manifest(snapshot_id)
            except DeltaSwapError:
                return None

    manifests = [m for m in await asyncio.gather(*map(read, ids)) if m is not None]
    return sorted((m for m in manifests if below is None or m.step < below), key=lambda m: -m.step)


async def _check_shard_sizes(store: Store, path: list[Manifest]) -> None:
    """Raise unless every shard of ``path`` is in the store with the size its manifest lists
    (sizes only: nothing is downloaded)."""
    for manifest in path:
        for shard in manifest.shards:
            size = await store.size(store_keys.shard_key(manifest.snapshot_id, shard.name))
            if size is None:
                raise NotFoundError(f"shard {shard.name} of {manifest.snapshot_id} is missing")
            if size >= 0 and size != shard.size:
                raise CorruptDataError(
                    f"shard {shard.name} of {manifest.snapshot_id} has {size} bytes, expected {shard.size}"
                )


async def _side_files(reader: ChainReader, path: list[Manifest]) -> dict[str, bytes]:
    """Side files (config, tokenizer) of the newest snapshot on the path that has them, verified;
    files that are not checkpoint side files are left out."""
    store: Store = reader.store
    for manifest in reversed(path):
        if manifest.files:
            files = {}
            for entry in manifest.files:
                if not is_side_file(entry.name):
                    log.warning(
                        "delta-swap: skipping %s of %s: not a checkpoint side file", entry.name, manifest.snapshot_id
                    )
                    continue
                data = await store.get(store_keys.file_key(manifest.snapshot_id, entry.name), max_bytes=entry.size)
                verify_blob(
                    data,
                    entry.checksum,
                    entry.sha256 if reader.trusted else None,
                    f"file {entry.name} of {manifest.snapshot_id}",
                )
                files[entry.name] = data
            return files
    return {}


# ---------------------------------------------------------------------- inspect


def _cmd_inspect(args: argparse.Namespace) -> int:
    manifests = asyncio.run(_list(args))
    rows: list[dict[str, Any]] = [
        {
            "snapshot_id": m.snapshot_id,
            "kind": m.kind.value,
            "prev_snapshot_id": m.prev_snapshot_id,
            "base_snapshot_id": m.base_snapshot_id,
            "run_id": m.run_id,
            "step": m.step,
            "payload_bytes": m.payload_bytes,
            "model_bytes": m.model_bytes,
            "tensors": len(m.tensors),
            "created_at": m.created_at,
        }
        for m in manifests
    ]
    runs = sorted({str(r["run_id"]) for r in rows})
    if len(runs) > 1:
        log.warning(
            "delta-swap: the store holds snapshots of %d runs (%s): a server or pull follows one of them",
            len(runs),
            ", ".join(runs),
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'snapshot_id':<18} {'kind':<5} {'step':>8} {'prev':<18} {'run':<20} {'payload':>12} {'% model':>8}")
    for r in rows:
        pct = 100.0 * r["payload_bytes"] / max(1, r["model_bytes"])
        print(
            f"{r['snapshot_id']:<18} {r['kind']:<5} {r['step']:>8} {r['prev_snapshot_id'] or '-':<18} "
            f"{r['run_id'] or '-':<20} {r['payload_bytes']:>12} {pct:>7.2f}%"
        )
    return 0


async def _list(args: argparse.Namespace) -> list[Manifest]:
    store = open_store(args.store)
    try:
        manifests = await ChainReader(store, _trusted(args)).list()
        if not manifests:
            raise NotFoundError(f"no snapshots in store {store.public_url}")
        return manifests
    finally:
        await store.close()


# ---------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="delta-swap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    trusted_help = (
        "accept only snapshots signed by this public key (KEY.pub; comma-separated for several). "
        "Env: DELTA_SWAP_TRUSTED_KEY"
    )

    p = sub.add_parser("keygen", help="create an Ed25519 key pair for signing snapshots")
    p.add_argument("--out", required=True, help="private key file to write (mode 0600); the public key goes to OUT.pub")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("publish", help="publish a Hugging Face checkpoint directory as the next snapshot")
    p.add_argument("checkpoint_dir", help="folder with *.safetensors and config/tokenizer files")
    p.add_argument("--step", required=True, type=int, help="training step of this checkpoint")
    p.add_argument("--base", action="store_true", help="force a full base snapshot (also on a damaged chain)")
    _publish_flags(p)
    p.add_argument(
        "--head-cache",
        help="folder keeping a copy of the last published tensors, so the next delta needs no "
        f"rebuild of the store's head (checked against its checksums first). Env: {head_cache.ENV_VAR} "
        "(default: ~/.cache/delta-swap/heads)",
    )
    p.add_argument("--no-head-cache", action="store_true", help="rebuild the store's head for every delta")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser(
        "watch",
        help="publish every checkpoint folder a trainer writes (checkpoint-N, step_N, global_step_N) "
        "as step N, from one long-lived process",
    )
    p.add_argument("folder", help="the folder the trainer saves its checkpoint folders into")
    _publish_flags(p)
    p.add_argument("--settle-s", type=float, default=5.0, help="a folder counts once unchanged this long (default 5)")
    p.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks at the folder (default 1)")
    p.add_argument("--until-step", type=int, help="exit once this step is published (default: run until stopped)")
    p.set_defaults(func=_cmd_watch)
    _add_read_commands(sub, trusted_help)
    return parser


def _publish_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``publish`` and ``watch`` share."""
    p.add_argument("--store", required=True, help="store URL: file:///path, a plain path, s3://bucket/prefix")
    p.add_argument("--base-every", type=int, default=25, help="publish a full base every N steps (default 25)")
    p.add_argument(
        "--max-delta-fraction",
        type=float,
        default=0.5,
        help="publish a base instead when a delta exceeds this fraction of the model (default 0.5)",
    )
    p.add_argument("--signing-key", help="sign the snapshot with this private key. Env: DELTA_SWAP_SIGNING_KEY")
    p.add_argument(
        "--run-id",
        help="the run to publish (default: the run of the store's newest snapshot that "
        "verifies, or a new one); snapshots of other runs are ignored",
    )
    p.add_argument(
        "--encode-threads",
        type=int,
        help="threads that encode the tensors (default: every core this process may run on)",
    )
    p.add_argument(
        "--level",
        type=int,
        choices=sorted(codec.LEVELS),
        default=codec.CodecConfig().level,
        help="encoder level: "
        + "; ".join(f"{k} {v}" for k, v in sorted(codec.LEVELS.items()))
        + " (default %(default)s; benchmarks/README.md, 'Encoder levels')",
    )


def _add_read_commands(sub: Any, trusted_help: str) -> None:
    """``pull`` and ``inspect``."""
    p = sub.add_parser("pull", help="rebuild a snapshot as a Hugging Face checkpoint directory")
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--out", required=True, help="output folder (replaced atomically; see --force)")
    p.add_argument("--snapshot", help="snapshot id (default: the newest)")
    p.add_argument("--trusted-key", help=trusted_help)
    p.add_argument("--max-model-bytes", type=int, help="refuse snapshots whose tensors add up to more bytes")
    p.add_argument("--force", action="store_true", help="replace --out even if it is not an earlier pull")
    p.add_argument(
        "--allow-older",
        action="store_true",
        help="replace an earlier pull in --out with an older step or a snapshot of another run",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("inspect", help="list the snapshots in a store, oldest first")
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--trusted-key", help=trusted_help)
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p.set_defaults(func=_cmd_inspect)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    interrupted = False
    try:
        return args.func(args)
    except KeyboardInterrupt:
        interrupted = True
        return 130
    except Exception as exc:
        if os.environ.get("DELTA_SWAP_DEBUG"):
            raise
        known = isinstance(exc, (DeltaSwapError, OSError, ValueError))
        message = " ".join(str(exc).split()) or type(exc).__name__
        kind = "error" if known else f"unexpected error ({type(exc).__name__})"
        print(f"delta-swap {args.command}: {kind}: {message}", file=sys.stderr)
        return 1 if known else 2
    finally:
        if not interrupted:
            _wait_for_codec_warm_up(quiet=getattr(args, "quiet", False))


def _wait_for_codec_warm_up(quiet: bool) -> None:
    """Wait for the codec warm-up a publisher started in this process (it compiles in a child
    process, which the exit would stop: the next command would then compile again). Cold, once
    per machine, this is the codec's compile; with its cache, under a second."""
    for thread in threading.enumerate():
        if thread.name == WARM_UP_THREAD and thread.is_alive():
            if not quiet:
                print(
                    "delta-swap: waiting for the codec's compile to finish (once per machine; cached after)",
                    file=sys.stderr,
                )
            thread.join()


def run() -> NoReturn:
    """The ``delta-swap`` command: :func:`main`, then a quick exit. The interpreter's own
    finalization (mostly numba's and LLVM's teardown) takes ~0.3 s, which a trainer that runs
    ``delta-swap publish`` at every step would pay every step. So once :func:`main` returned, what
    a normal exit does before that teardown runs, in its order: threading's exit hooks (idle
    ``concurrent.futures`` workers told to stop) and the join of the threads that are not daemons
    (``threading._shutdown``, as the interpreter calls it), then the atexit hooks (logging's
    flush, the codec warm-up's stop); stdout and stderr are flushed, and the process ends."""
    code = main()
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own first step at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
