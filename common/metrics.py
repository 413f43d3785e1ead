"""Prometheus metrics of the subscriber, registered in prometheus_client's default registry so
they are exported next to the engine's own metrics (vLLM's and SGLang's ``/metrics``)."""

from __future__ import annotations

from functools import lru_cache

from prometheus_client import Counter, Gauge, Histogram

from .errors import (
    ChainError,
    ChecksumMismatchError,
    CorruptDataError,
    IncompatibleSnapshotError,
    NotFoundError,
    SignatureError,
    StoreError,
)


class SubscriberMetrics:
    """One set per process (a server runs one subscriber)."""

    def __init__(self) -> None:
        self.current_step = Gauge("delta_swap_current_step", "Step of the snapshot the engine serves")
        self.newest_step = Gauge("delta_swap_newest_step", "Step of the newest snapshot seen in the store")
        self.staleness_steps = Gauge("delta_swap_staleness_steps", "Steps the engine is behind the store")
        self.staleness_seconds = Gauge(
            "delta_swap_staleness_seconds", "Seconds since the newest unapplied snapshot was published"
        )
        self.published_step_seen = Gauge(
            "delta_swap_published_step_seen", "Newest step the trainer's heartbeat says it published"
        )
        self.trainer_seen_seconds = Gauge(
            "delta_swap_trainer_seen_seconds", "Seconds since the trainer last wrote its heartbeat"
        )
        self.bytes_fetched = Counter("delta_swap_fetched_bytes", "Bytes fetched from the store")
        self.updates = Counter("delta_swap_updates", "Snapshots swapped into the engine")
        self.failures = Counter("delta_swap_failures", "Failed updates by kind", ["kind"])
        self.phase_seconds = Histogram(
            "delta_swap_phase_seconds",
            "Duration of each update phase",
            ["phase"],
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )


@lru_cache(maxsize=1)
def subscriber_metrics() -> SubscriberMetrics:
    """The process-wide metrics (created on first use)."""
    return SubscriberMetrics()


def failure_kind(exc: BaseException) -> str:
    """A short label for what went wrong."""
    if isinstance(exc, SignatureError):
        return "signature"
    if isinstance(exc, ChecksumMismatchError):
        return "checksum"
    if isinstance(exc, CorruptDataError):
        return "corrupt"
    if isinstance(exc, ChainError):
        return "chain"
    if isinstance(exc, IncompatibleSnapshotError):
        return "misfit"
    if isinstance(exc, NotFoundError):
        return "missing"
    if isinstance(exc, (StoreError, OSError, TimeoutError)):
        return "store"
    return "engine"
