"""Exceptions raised by delta-swap. Every failure a user can cause maps to one of these."""

from __future__ import annotations


class DeltaSwapError(Exception):
    """Base class of every delta-swap error."""


class CorruptDataError(DeltaSwapError):
    """A payload, shard or manifest is malformed, truncated or inconsistent."""


class ChecksumMismatchError(CorruptDataError):
    """Rebuilt bytes do not match the checksum recorded by the publisher."""


class FormatVersionError(CorruptDataError):
    """A manifest uses a format version this build cannot read."""


class ChainError(DeltaSwapError):
    """Snapshots do not link up: a missing, out-of-order or foreign delta."""


class IncompatibleSnapshotError(DeltaSwapError):
    """A snapshot's tensors do not fit the model a server runs (names, shapes or dtypes)."""


class StoreError(DeltaSwapError):
    """A store could not be reached or refused an operation."""


class NotFoundError(StoreError):
    """The key (or the store itself) does not exist."""
