"""The file store's atomic writes and key checks, safetensors parsing, and manifest checks."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from delta_swap.errors import CorruptDataError, NotFoundError, StoreError
from delta_swap.safetensors_io import parse_header, read_safetensors
from delta_swap.stores import FileStore, open_store


async def test_file_store_round_trip_list_and_ranges(tmp_path) -> None:
    store = open_store(f"file://{tmp_path}/s", create=True)
    await store.put("a/b/c.bin", b"0123456789")
    await store.put("a/x", b"1")
    assert await store.get("a/b/c.bin") == b"0123456789"
    assert await store.get("a/b/c.bin", 2, 5) == b"234"
    assert await store.size("a/b/c.bin") == 10 and await store.size("nope") is None
    assert await store.list("a/") == ["a/b/c.bin", "a/x"]
    assert await store.list("a/b") == ["a/b/c.bin"]
    await store.delete("a/x")
    with pytest.raises(NotFoundError):
        await store.get("a/x")
    assert not list((tmp_path / "s" / "a").glob(".tmp-*"))


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/etc/passwd", "a//b", ".hidden", "a/b\x00", ""])
async def test_keys_that_could_escape_the_root_are_refused(tmp_path, key) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(StoreError):
        await store.put(key, b"x")
    with pytest.raises(StoreError):
        await store.get(key)


def test_a_missing_folder_is_not_found_and_an_unknown_scheme_a_store_error(tmp_path) -> None:
    with pytest.raises(NotFoundError):
        open_store(str(tmp_path / "missing"))
    with pytest.raises(StoreError, match="unsupported store URL"):
        open_store("gopher://host/x")


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_safetensors_parser_rejects_bad_headers() -> None:
    good = _safetensors({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    assert read_safetensors(good)["t"].shape == (2,)
    bad = [
        good[:4],
        struct.pack("<Q", 2**40) + good[8:],
        _safetensors({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        _safetensors({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        _safetensors({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        _safetensors({"t": {"dtype": "NOPE", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        _safetensors({"t": {"shape": [2]}}, b"\0" * 8),
        struct.pack("<Q", 3) + b"{{{",
    ]
    for data in bad:
        with pytest.raises(CorruptDataError):
            read_safetensors(data)
    with pytest.raises(CorruptDataError):
        parse_header(np.frombuffer(good, np.uint8).tobytes()[:10], len(good))
