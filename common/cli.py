"""The ``delta-swap`` command: publish, pull and inspect snapshot chains."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from . import store_keys
from .chain import ChainReader
from .checkpoint_dir import read_checkpoint_dir, write_checkpoint_dir
from .checksum import verify
from .errors import DeltaSwapError, NotFoundError
from .manifest import Manifest
from .publisher import Publisher, PublisherConfig
from .rebuild import rebuild
from .stores import Store, open_store


@contextmanager
def _progress(desc: str, total: int | None, enabled: bool) -> Iterator:
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr) as bar:
        yield bar.update


def _cmd_publish(args: argparse.Namespace) -> int:
    state, files = read_checkpoint_dir(args.checkpoint_dir)
    config = PublisherConfig(base_every=args.base_every, max_delta_fraction=args.max_delta_fraction)
    total = sum(t.nbytes for t in state.values())
    with _progress("publish", total, not args.quiet) as update, Publisher(args.store, config, files, update) as pub:
        snapshot_id = pub.publish(args.step, state, force_base=args.base)
        pub.flush()
    manifest = asyncio.run(_manifest(args.store, snapshot_id))
    print(f"published {manifest.snapshot_id} ({manifest.kind}, step {manifest.step}): "
          f"{manifest.payload_bytes} bytes stored for {manifest.model_bytes} model bytes")
    return 0


async def _manifest(url: str, snapshot_id: str) -> Manifest:
    store = open_store(url)
    try:
        return await ChainReader(store).manifest(snapshot_id)
    finally:
        await store.close()


def _cmd_pull(args: argparse.Namespace) -> int:
    manifest, nbytes = asyncio.run(_pull(args))
    print(f"pulled {manifest.snapshot_id} (step {manifest.step}) into {args.out}: {nbytes} tensor bytes verified")
    return 0


async def _pull(args: argparse.Namespace) -> tuple[Manifest, int]:
    store = open_store(args.store)
    try:
        reader = ChainReader(store)
        with _progress("fetch", None, not args.quiet) as update:
            manifest, state, path = await rebuild(store, args.snapshot, reader=reader, progress=update)
        files = await _side_files(store, path)
        with _progress("write", manifest.model_bytes, not args.quiet) as update:
            await asyncio.to_thread(write_checkpoint_dir, args.out, state, files, progress=update)
        return manifest, manifest.model_bytes
    finally:
        await store.close()


async def _side_files(store: Store, path: list[Manifest]) -> dict[str, bytes]:
    """Non-tensor files (config, tokenizer) of the newest snapshot on the path that has them."""
    for manifest in reversed(path):
        if manifest.files:
            files = {}
            for entry in manifest.files:
                data = await store.get(store_keys.file_key(manifest.snapshot_id, entry.name))
                verify(data, entry.checksum, f"file {entry.name} of {manifest.snapshot_id}")
                files[entry.name] = data
            return files
    return {}


def _cmd_inspect(args: argparse.Namespace) -> int:
    manifests = asyncio.run(_list(args.store))
    rows = [
        {"snapshot_id": m.snapshot_id, "kind": m.kind, "prev_snapshot_id": m.prev_snapshot_id,
         "base_snapshot_id": m.base_snapshot_id, "step": m.step, "payload_bytes": m.payload_bytes,
         "model_bytes": m.model_bytes, "tensors": len(m.tensors), "created_at": m.created_at}
        for m in manifests
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'snapshot_id':<18} {'kind':<5} {'step':>8} {'prev':<18} {'payload':>12} {'% model':>8}")
    for r in rows:
        pct = 100.0 * r["payload_bytes"] / max(1, r["model_bytes"])
        print(f"{r['snapshot_id']:<18} {r['kind']:<5} {r['step']:>8} {r['prev_snapshot_id'] or '-':<18} "
              f"{r['payload_bytes']:>12} {pct:>7.2f}%")
    return 0


async def _list(url: str) -> list[Manifest]:
    store = open_store(url)
    try:
        manifests = await ChainReader(store).list()
        if not manifests:
            raise NotFoundError(f"no snapshots in store {url}")
        return manifests
    finally:
        await store.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="delta-swap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("publish", help="publish a Hugging Face checkpoint directory as the next snapshot")
    p.add_argument("checkpoint_dir", help="folder with *.safetensors and config/tokenizer files")
    p.add_argument("--store", required=True, help="store URL: file:///path, a plain path, s3://bucket/prefix")
    p.add_argument("--step", required=True, type=int, help="training step of this checkpoint")
    p.add_argument("--base-every", type=int, default=25, help="publish a full base every N steps (default 25)")
    p.add_argument("--base", action="store_true", help="force a full base snapshot")
    p.add_argument("--max-delta-fraction", type=float, default=0.5,
                   help="publish a base instead when a delta exceeds this fraction of the model (default 0.5)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser("pull", help="rebuild a snapshot as a Hugging Face checkpoint directory")
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--snapshot", help="snapshot id (default: the newest)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("inspect", help="list the snapshots in a store, oldest first")
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (DeltaSwapError, OSError, ValueError) as exc:
        print(f"delta-swap {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
