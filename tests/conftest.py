"""Shared fixtures, and the default run's share of the engine matrix."""

from __future__ import annotations

import os

import numpy as np
import pytest

#: Set to 1 to run every cell of the engine matrix (family x swap path x layout), as
#: ``benchmarks/support_matrix.py`` wants; the default run takes each path and layout with the
#: families that break it, and skips the cells marked ``full_matrix``, saying which cell covers them.
FULL_MATRIX_ENV = "DELTA_SWAP_FULL_MATRIX"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The machine the run had (the CPU flags decide which swap path each engine takes), at the
    end of the output, where a CI log's tail shows it."""
    from benchmarks.machine import cpu_flags

    terminalreporter.write_line(f"machine: {cpu_flags()}; {os.cpu_count()} cores")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(FULL_MATRIX_ENV) == "1":
        return
    for item in items:
        mark = item.get_closest_marker("full_matrix")
        if mark is not None:
            covered_by = mark.args[0] if mark.args else "other cells"
            item.add_marker(pytest.mark.skip(reason=f"full matrix only ({FULL_MATRIX_ENV}=1); covered by {covered_by}"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _freshness_records_apart(tmp_path_factory, monkeypatch) -> None:
    """Servers record the newest snapshot they verified beside their staging dir (/dev/shm), one
    file per store URL; each test keeps those records in a folder of its own, so a rerun of a test
    (the same S3 prefix) never meets the record of an earlier run."""
    from delta_swap import freshness

    folder = str(tmp_path_factory.mktemp("freshness"))
    original = freshness.record_path
    monkeypatch.setattr(freshness, "record_path", lambda staging_dir, store_url: original(folder, store_url))


@pytest.fixture(autouse=True)
def _head_cache_apart(tmp_path_factory, monkeypatch) -> None:
    """``delta-swap publish`` keeps a copy of the tensors it published (``delta_swap.head_cache``);
    in tests that copy goes to a folder of the test's own, not the user's ~/.cache."""
    monkeypatch.setenv("DELTA_SWAP_HEAD_CACHE", str(tmp_path_factory.mktemp("heads")))


@pytest.fixture(scope="session", autouse=True)
def _codec_kernels_compiled() -> None:
    """Compile (or load from numba's disk cache) codec v2's kernels once per session, before the
    first test: a cold compile takes minutes on 2 cores and would otherwise land in whichever test
    decodes first. Servers the tests start load the kernels from the cache this fills."""
    from delta_swap import codec

    codec.warm_up()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """A real S3 store for the session: SeaweedFS (master, volume, filer) with an S3 gateway that
    checks signatures against two identities (the trainer's, which may write, and the servers',
    read only) and an identity-less gateway on the same data for a fault-injecting proxy
    (examples/servers/seaweedfs.py), holding the bucket ``rl-snapshots``. Stopped at the end."""
    from examples.servers.seaweedfs import SeaweedFS

    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), open_gateway=True) as cluster:
        cluster.create_bucket("rl-snapshots")
        yield cluster
