"""Store backends and :func:`open_store`, which picks one from a URL."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote, urlparse

from ..errors import StoreError
from .base import Store, check_key, public_url
from .file import FileStore

_BACKENDS: dict[str, Callable[[str, bool], Store]] = {}


def register_backend(scheme: str, factory: Callable[[str, bool], Store]) -> None:
    """Make ``open_store`` build ``factory(url, create)`` for URLs of ``scheme``."""
    _BACKENDS[scheme] = factory


def _open_file(url: str, create: bool) -> Store:
    parsed = urlparse(url)
    path = unquote(parsed.path) if parsed.scheme == "file" else url
    if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
        raise StoreError(f"file URLs must be local: {public_url(url)}")
    return FileStore(path, create=create)


def _open_s3(url: str, create: bool) -> Store:
    from .s3 import S3Store

    return S3Store(url)


def _open_http(url: str, create: bool) -> Store:
    from .http import HttpStore

    return HttpStore(url)


register_backend("file", _open_file)
register_backend("s3", _open_s3)
register_backend("http", _open_http)
register_backend("https", _open_http)


def open_store(url: str, *, create: bool = False) -> Store:
    """Open the store at ``url``: ``file://...`` or a plain path, ``s3://bucket/prefix``,
    ``http(s)://...`` (read only), or any scheme added with :func:`register_backend`.

    With ``create=False`` a missing local store raises NotFoundError instead of being made.
    """
    scheme = urlparse(url).scheme
    if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):
        return _open_file(url, create)
    if scheme not in _BACKENDS:
        raise StoreError(f"unsupported store URL {public_url(url)!r} (known schemes: {', '.join(sorted(_BACKENDS))})")
    return _BACKENDS[scheme](url, create)


__all__ = ["Store", "FileStore", "open_store", "register_backend", "check_key"]
