"""Signed snapshots: Ed25519 signatures over manifests, through ``cryptography``.

A publisher with a signing key writes ``snapshots/<id>/manifest.sig`` next to each manifest,
before the manifest itself. The signature covers the manifest's exact bytes, and the manifest
lists every shard and side file with its size and SHA-256, so one verified signature
authenticates every byte of the snapshot. Readers with trusted public keys verify the signature
before they parse the manifest or fetch anything it names.

The same keys sign two smaller objects, each under its own context so no signature can be replayed
as another kind: a multi-rank trainer's parts (``snapshots/<id>/parts/rank-R.sig``, checked by the
committing rank) and the trainer's heartbeat (:mod:`.heartbeat`).

Key files are PEM: the private key as unencrypted PKCS#8 (written with mode 0600), the public key
as SubjectPublicKeyInfo in ``KEY.pub``. A key is named by its id, the first 16 hex digits of the
SHA-256 of its raw public bytes, so several trusted keys (rotation) are told apart.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, SignatureError

SIGNATURE_FORMAT = "delta-swap-signature"
ALGORITHM = "ed25519"
#: Domain separation: a signature over one kind of object can never be replayed as another's.
MANIFEST_CONTEXT = b"delta-swap/manifest/v1\x00"
PART_CONTEXT = b"delta-swap/part/v1\x00"
HEARTBEAT_CONTEXT = b"delta-swap/heartbeat/v1\x00"
MAX_SIGNATURE_BYTES = 4096


def key_id(public_bytes: bytes) -> str:
    """The id of a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(public_bytes).hexdigest()[:16]


@dataclass(frozen=True)
class SigningKey:
    """A private key that signs manifests."""

    private: object  # Ed25519PrivateKey
    key_id: str

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Read a PEM private key written by :func:`generate_keypair` (``delta-swap keygen``)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            private = load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"cannot read signing key {path}: {exc}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise ConfigError(f"signing key {path} is not an Ed25519 key")
        return cls(private, key_id(_raw_public(private.public_key())))

    def sign(self, data: bytes, context: bytes = MANIFEST_CONTEXT) -> bytes:
        """A signature document (the contents of ``manifest.sig``) over ``data`` in ``context``."""
        signature = self.private.sign(context + data)  # type: ignore[attr-defined]
        doc = {
            "format": SIGNATURE_FORMAT,
            "algorithm": ALGORITHM,
            "key_id": self.key_id,
            "signature": base64.b64encode(signature).decode(),
        }
        return json.dumps(doc).encode()

    def trusted(self) -> TrustedKeys:
        """The public half, as the keys a reader trusts (a publisher checks its own objects)."""
        public = self.private.public_key()  # type: ignore[attr-defined]
        return TrustedKeys({self.key_id: public})


@dataclass(frozen=True)
class TrustedKeys:
    """Public keys whose signatures a reader accepts (several during a key rotation)."""

    keys: dict[str, object]  # key id -> Ed25519PublicKey

    @classmethod
    def load(cls, paths: Iterable[str | os.PathLike[str]]) -> TrustedKeys:
        """Read PEM public keys (``KEY.pub`` files)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        keys: dict[str, object] = {}
        for path in paths:
            try:
                public = load_pem_public_key(Path(path).read_bytes())
            except (OSError, ValueError, TypeError) as exc:
                raise ConfigError(f"cannot read trusted key {path}: {exc}") from None
            if not isinstance(public, Ed25519PublicKey):
                raise ConfigError(f"trusted key {path} is not an Ed25519 public key")
            keys[key_id(_raw_public(public))] = public
        if not keys:
            raise ConfigError("no trusted keys given")
        return cls(keys)

    def __or__(self, other: TrustedKeys) -> TrustedKeys:
        return TrustedKeys({**self.keys, **other.keys})

    def verify(self, manifest_bytes: bytes, signature_doc: bytes, snapshot_id: str) -> str:
        """Return the id of the key that signed ``manifest_bytes``; raise SignatureError unless
        ``signature_doc`` is a valid signature by one of these keys."""
        return self.verify_object(manifest_bytes, signature_doc, f"snapshot {snapshot_id}", "manifest")

    def verify_object(
        self, data: bytes, signature_doc: bytes | str, subject: str, noun: str, context: bytes = MANIFEST_CONTEXT
    ) -> str:
        """:meth:`verify` for any signed object: ``subject`` and ``noun`` name it in errors."""
        from cryptography.exceptions import InvalidSignature

        try:
            doc = json.loads(signature_doc)
            if not isinstance(doc, dict) or doc.get("format") != SIGNATURE_FORMAT or doc.get("algorithm") != ALGORITHM:
                raise ValueError("not an Ed25519 delta-swap signature")
            signer, signature = str(doc["key_id"]), base64.b64decode(str(doc["signature"]), validate=True)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise SignatureError(f"{subject}: malformed signature ({exc})") from None
        public = self.keys.get(signer)
        if public is None:
            raise SignatureError(f"{subject} is signed by key {signer[:16]!r}, which is not trusted")
        try:
            public.verify(signature, context + data)  # type: ignore[attr-defined]
        except InvalidSignature:
            raise SignatureError(f"{subject}: the signature does not match the {noun}") from None
        return signer


def generate_keypair(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new private key to ``path`` (mode 0600) and its public key to ``path.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key_path = Path(path)
    pub_path = key_path.with_name(key_path.name + ".pub")
    if key_path.exists():
        raise ConfigError(f"{key_path} exists; refusing to overwrite a key")
    key_path.parent.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub_path.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return key_path, pub_path


def split_paths(value: str | None) -> list[str]:
    """Key paths from a setting: comma-separated (``a.pub,b.pub``)."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def _raw_public(public: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)  # type: ignore[attr-defined]
