"""Server-sent events for test clients, split on the line ends SSE allows and nothing else.

httpx's ``iter_lines`` splits like ``str.splitlines``: also on U+0085, U+2028, U+2029 and other
separators, which a random model's tokens decode to and an engine writes into its JSON as they
are. One CI run lost a stream that way (the line ended inside a string, ``JSONDecodeError``)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable, Iterator

_LINE_END = re.compile(r"\r\n|\r|\n")


def _split(buffer: str) -> tuple[list[str], str]:
    """Whole lines in ``buffer`` and the unfinished rest (a trailing CR waits: it may start CRLF)."""
    held = "\r" if buffer.endswith("\r") else ""
    parts = _LINE_END.split(buffer[: len(buffer) - len(held)])
    return parts[:-1], parts[-1] + held


def sse_lines(texts: Iterable[str]) -> Iterator[str]:
    """The lines of a stream given as decoded text chunks."""
    rest = ""
    for text in texts:
        lines, rest = _split(rest + text)
        yield from lines
    if rest:
        yield rest.rstrip("\r")


async def asse_lines(texts: AsyncIterator[str]) -> AsyncIterator[str]:
    """Like :func:`sse_lines`, for an async stream."""
    rest = ""
    async for text in texts:
        lines, rest = _split(rest + text)
        for line in lines:
            yield line
    if rest:
        yield rest.rstrip("\r")


def data_documents(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON documents of the ``data:`` lines (``[DONE]`` and other lines skipped)."""
    for line in lines:
        if line.startswith("data:") and line[5:].strip().startswith("{"):
            yield json.loads(line[5:])
