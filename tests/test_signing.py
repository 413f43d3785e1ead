"""Signed snapshots: keygen, signing publishers, and readers that accept only trusted signatures
(the CLI as a user runs it, and a subscriber that refuses before fetching anything)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from delta_swap import store_keys
from delta_swap.checksum import checksum, sha256
from delta_swap.errors import ConfigError, SignatureError
from delta_swap.publisher import Publisher, PublisherConfig
from delta_swap.settings import Settings
from delta_swap.signing import SigningKey, TrustedKeys, generate_keypair
from delta_swap.subscriber import Subscriber
from delta_swap.testing import RecordingAdapter
from tests.support.chains import assert_state_equal, rl_steps

CLI = [sys.executable, "-m", "delta_swap.cli"]


def _cli(*args: str, ok: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert (proc.returncode == 0) == ok, proc.stderr
    if not ok:
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("trainer", "rotated", "stranger"):
        out[name] = root / f"{name}.key"
        _cli("keygen", "--out", str(out[name]))
    return out


def _publish(store: Path, steps, key: Path | None, start: int = 0) -> None:
    with Publisher(
        str(store),
        PublisherConfig(base_every=100, signing_key=str(key) if key else None),
        files={"config.json": b'{"model_type": "llama"}'},
    ) as pub:
        for i, s in enumerate(steps):
            pub.publish(start + i, s)


def test_keygen_writes_a_private_key_only_its_owner_reads(keys) -> None:
    key = keys["trainer"]
    assert key.stat().st_mode & 0o777 == 0o600
    assert Path(f"{key}.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_keypair(key)
    with pytest.raises(ConfigError, match="cannot read signing key"):
        SigningKey.load(f"{key}.pub")  # a public key where the private one belongs


def test_signed_chain_pulls_only_with_a_trusting_key(tmp_path, keys) -> None:
    store = tmp_path / "store"
    _publish(store, rl_steps(3), keys["trainer"])
    sig = json.loads((store / store_keys.signature_key("step-0000000002")).read_text())
    assert sig["algorithm"] == "ed25519" and sig["key_id"] == SigningKey.load(keys["trainer"]).key_id
    manifest = json.loads((store / store_keys.manifest_key("step-0000000002")).read_text())
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"] + manifest["files"])

    trusted = f"{keys['trainer']}.pub"
    rotated = f"{keys['rotated']}.pub,{trusted}"  # several trusted keys during a rotation
    _cli("pull", "--store", str(store), "--out", str(tmp_path / "a"), "--quiet", "--trusted-key", trusted)
    _cli(
        "pull", "--store", str(store), "--out", str(tmp_path / "b"), "--quiet", env={"DELTA_SWAP_TRUSTED_KEY": rotated}
    )
    assert "step-0000000002" in _cli("inspect", "--store", str(store), "--trusted-key", trusted).stdout
    err = _cli(
        "pull",
        "--store",
        str(store),
        "--out",
        str(tmp_path / "c"),
        "--quiet",
        "--trusted-key",
        f"{keys['stranger']}.pub",
        ok=False,
    ).stderr
    assert "SignatureError" not in err and "not trusted" in err
    assert not (tmp_path / "c").exists()


def test_an_unsigned_or_tampered_snapshot_is_refused_with_a_trusted_key(tmp_path, keys) -> None:
    store = tmp_path / "store"
    _publish(store, rl_steps(2), keys["trainer"])
    _publish(store, rl_steps(3)[2:], None, start=2)  # someone with write access adds an unsigned step
    trusted = f"{keys['trainer']}.pub"
    err = _cli(
        "pull", "--store", str(store), "--out", str(tmp_path / "o"), "--quiet", "--trusted-key", trusted, ok=False
    ).stderr
    assert "step-0000000002 is not signed" in err and "step-0000000001" in err  # names the newest good one
    # Without a trusted key the unsigned step is accepted, and the CLI says snapshots are not authenticated.
    out = _cli("pull", "--store", str(store), "--out", str(tmp_path / "o"), "--quiet")
    assert "not authenticated" in out.stderr

    # A tampered manifest with recomputed checksums: consistent, but the signature no longer matches.
    path = store / store_keys.manifest_key("step-0000000001")
    doc = json.loads(path.read_text())
    doc["metadata"] = {"injected": "yes"}
    path.write_text(json.dumps(doc))
    err = _cli("inspect", "--store", str(store), "--trusted-key", trusted, ok=False).stderr
    assert "signature does not match" in err


async def test_signed_sha256_binds_shard_bytes_even_if_xxh3_were_forged(tmp_path, keys) -> None:
    """xxh3 is not a cryptographic hash: with a trusted key, the signed SHA-256 of every shard is
    checked too. Here the manifest's xxh3 is made to match altered bytes (as a collision would)."""
    import dataclasses

    from delta_swap.chain import ChainReader
    from delta_swap.errors import ChecksumMismatchError
    from delta_swap.rebuild import fetch_shards
    from delta_swap.stores import FileStore

    store_dir = tmp_path / "store"
    _publish(store_dir, rl_steps(2), keys["trainer"])
    store = FileStore(store_dir)
    manifest = await ChainReader(store, TrustedKeys.load([f"{keys['trainer']}.pub"])).manifest("step-0000000001")
    shard = manifest.shards[0]
    path = store_dir / store_keys.shard_key(manifest.snapshot_id, shard.name)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    forged = dataclasses.replace(manifest, shards=(dataclasses.replace(shard, checksum=checksum(bytes(data))),))
    assert len(await fetch_shards(store, forged)) == 1  # xxh3 alone is fooled
    with pytest.raises(ChecksumMismatchError, match="SHA-256"):
        await fetch_shards(store, forged, authenticated=True)
    assert sha256(bytes(data)) != shard.sha256


async def test_a_server_refuses_unsigned_snapshots_before_fetching_them(tmp_path, keys) -> None:
    steps = rl_steps(3)
    store = tmp_path / "store"
    _publish(store, steps[:2], keys["trainer"])
    engine = RecordingAdapter()
    sub = Subscriber(Settings(store=str(store), trusted_key=f"{keys['trainer']}.pub"), engine)
    assert await sub.sync() and sub.current.step == 1 and sub.status()["authenticated"]
    _publish(store, steps[2:], None, start=2)
    for shard in (store / "snapshots" / "step-0000000002").glob("shard-*"):
        shard.unlink()  # a fetch would fail with NotFoundError: the signature check comes first
    assert not await sub.sync()
    st = sub.status()
    assert st["current_step"] == 1 and st["last_error_kind"] == "signature" and "not signed" in st["last_error"]
    await sub.stop()
    assert_state_equal(engine.weights, steps[1])


def test_signature_documents_are_checked_strictly(keys) -> None:
    trusted = TrustedKeys.load([f"{keys['trainer']}.pub"])
    good = SigningKey.load(keys["trainer"]).sign(b"manifest bytes")
    assert trusted.verify(b"manifest bytes", good, "s") == SigningKey.load(keys["trainer"]).key_id
    for bad in (
        b"",
        b"[]",
        b'{"format": "delta-swap-signature"}',
        good.replace(b'"ed25519"', b'"rsa"'),
        good[:-12] + b'AAAAAAAA"}',
        b"{" * 100000,
    ):
        with pytest.raises(SignatureError):
            trusted.verify(b"manifest bytes", bad, "s")
    with pytest.raises(SignatureError, match="does not match"):
        trusted.verify(b"other bytes", good, "s")
