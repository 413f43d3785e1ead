"""Every exception delta-swap raises, in one hierarchy.

::

    DeltaSwapError                    anything delta-swap refuses or fails to do
    ├── ConfigError (ValueError)      a bad setting, flag or argument
    ├── CorruptDataError              a payload, shard, manifest or HEAD is malformed or inconsistent
    │   ├── ChecksumMismatchError     bytes differ from the checksum the publisher recorded
    │   ├── FormatVersionError        a format version this build cannot read
    │   ├── ObjectTooLargeError       an object (or a server's answer) is larger than the reader allows
    │   └── SignatureError            a snapshot is unsigned, or not signed by a trusted key
    ├── ChainError                    snapshots do not link up (missing, out of order, foreign)
    │   └── RollbackError             an older snapshot, or another run's, than one verified before
    ├── IncompatibleSnapshotError     a snapshot does not fit the served model (names, dtypes, shapes)
    ├── StoreError                    a store could not be reached or refused an operation
    │   ├── NotFoundError             the key (or the store) does not exist
    │   └── TransientError            worth retrying: timeout, 5xx, dropped connection, short body
    ├── PublishError                  a background publish failed (the cause is chained)
    └── EngineError                   the inference engine refused or failed a weight update
        ├── SwapUndoneError           ... and put the previous weights back itself, on every rank
        └── EngineStateUnknownError   ... and restoring the previous weights failed too

Backends translate their own failures at the edge: the S3 and HTTP stores map botocore and
httpx errors to ``StoreError`` subclasses, and each engine adapter maps its engine's errors to
``EngineError`` in one place (``EngineAdapter.engine_error``). Everything above those layers
sees only these types, and the command line prints any of them as one line.
"""

from __future__ import annotations


class DeltaSwapError(Exception):
    """Base class of every delta-swap error."""


class ConfigError(DeltaSwapError, ValueError):
    """A setting, flag or argument has a value delta-swap cannot use."""


class CorruptDataError(DeltaSwapError):
    """A payload, shard, manifest or head pointer is malformed, truncated or inconsistent."""


class ChecksumMismatchError(CorruptDataError):
    """Rebuilt bytes do not match the checksum recorded by the publisher."""


class FormatVersionError(CorruptDataError):
    """A manifest uses a format version this build cannot read."""


class ObjectTooLargeError(CorruptDataError):
    """An object (or a server's answer) is larger than the reader allows."""


class SignatureError(CorruptDataError):
    """A snapshot is unsigned, or its signature does not verify with any trusted key."""


class ChainError(DeltaSwapError):
    """Snapshots do not link up: a missing, out-of-order or foreign delta."""


class RollbackError(ChainError):
    """A snapshot is older than, or of another run than, the one a reader verified before."""


class IncompatibleSnapshotError(DeltaSwapError):
    """A snapshot's tensors do not fit the model a server runs (names, shapes or dtypes)."""


class StoreError(DeltaSwapError):
    """A store could not be reached or refused an operation."""


class NotFoundError(StoreError):
    """The key (or the store itself) does not exist."""


class TransientError(StoreError):
    """A failure worth retrying: timeout, 5xx, dropped connection, short body."""


class PublishError(DeltaSwapError):
    """A background publish failed; raised from the next publish, flush or close."""


class EngineError(DeltaSwapError):
    """The inference engine refused or failed a weight update (its message is kept)."""


class SwapUndoneError(EngineError):
    """A swap failed and the engine put the previous weights back itself, on every rank, in the
    pause (each rank's undo log or old modules): the core has nothing to roll back."""


class EngineStateUnknownError(EngineError):
    """A swap failed and so did the rollback: the engine may hold a mix of versions, and the
    subscriber reloads every tensor from the newest base at its next poll."""
