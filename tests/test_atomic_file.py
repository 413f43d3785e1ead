"""delta_swap.atomic_file: a file is replaced whole or not at all."""

from __future__ import annotations

import pytest

from delta_swap.atomic_file import atomic_write


def test_a_write_replaces_the_file_and_makes_its_folder(tmp_path) -> None:
    path = tmp_path / "a" / "b" / "record.json"
    with atomic_write(path) as fh:
        fh.write(b"first")
    with atomic_write(path) as fh:
        fh.write(b"second")
    assert path.read_bytes() == b"second"
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary_file(tmp_path) -> None:
    path = tmp_path / "head.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(path, prefix=".tmp-head-") as fh:
        fh.write(b"half of the new")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-head-")]  # written aside
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["head.safetensors"]
