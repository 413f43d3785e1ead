"""The public API of ``delta_swap``: what ``__all__`` promises is exactly what is importable."""

from __future__ import annotations

import delta_swap

EXPECTED = {
    "__version__",
    # trainer side
    "Publisher",
    "PublisherConfig",
    # rollout side
    "Settings",
    "DrainPolicy",
    "Subscriber",
    "EngineAdapter",
    "WeightUpdate",
    "ServedModel",
    "apply_update",
    "RecordingAdapter",
    # format and stores
    "Manifest",
    "SnapshotKind",
    "Encoding",
    "Store",
    "open_store",
    "register_backend",
    # errors
    "DeltaSwapError",
    "ConfigError",
    "CorruptDataError",
    "ChecksumMismatchError",
    "FormatVersionError",
    "ChainError",
    "IncompatibleSnapshotError",
    "StoreError",
    "NotFoundError",
    "TransientError",
    "PublishError",
    "EngineError",
    "EngineStateUnknownError",
    "SwapUndoneError",
    "SignatureError",
}


def test_all_is_pinned_and_every_name_resolves() -> None:
    assert set(delta_swap.__all__) == EXPECTED
    for name in delta_swap.__all__:
        member = getattr(delta_swap, name)
        if name != "__version__":
            assert member.__module__.startswith("delta_swap."), name
    assert set(delta_swap.__all__) <= set(dir(delta_swap))


def test_every_error_is_a_delta_swap_error() -> None:
    for name in delta_swap.__all__:
        member = getattr(delta_swap, name)
        if isinstance(member, type) and name.endswith("Error"):
            assert issubclass(member, delta_swap.DeltaSwapError), name


def test_importing_the_package_does_not_import_prometheus_or_fastapi() -> None:
    """Engines configure Prometheus (multiprocess mode) after plugins load: the core must not
    import it, or FastAPI, before a subscriber is started."""
    import subprocess
    import sys

    code = (
        "import sys, delta_swap, delta_swap.settings\n"
        "print(sorted(m for m in ('prometheus_client', 'fastapi', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
