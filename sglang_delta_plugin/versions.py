"""Wrap SGLang's ``tokenizer_manager.generate_request``, which every route calls, so that:

* the weight-version spans of every choice reach delta-swap's middleware on the OpenAI-compatible
  routes (SGLang puts ``meta_info.weight_versions`` on every finished output, but its OpenAI routes
  return them only for the first choice of a non-streaming response):
  :func:`delta_swap.version_tags.record`;
* every request's radix-cache salt includes the snapshot served when it was admitted, so no new
  request reuses KV computed with other weights, even while requests kept in place hold old KV.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from delta_swap.version_tags import current_recorder, record


def salt(obj: Any, version: str | None) -> None:
    """Add ``version`` to a generate request's radix-cache salt (one or one per batch item)."""
    if not version or not hasattr(obj, "cache_salt"):
        return
    current = obj.cache_salt
    if isinstance(current, list):
        obj.cache_salt = [f"{s}|{version}" if s else version for s in current]
    else:
        obj.cache_salt = f"{current}|{version}" if current else version


def instrument(tokenizer_manager: Any, version_of: Callable[[], str | None]) -> None:
    """Wrap ``tokenizer_manager.generate_request`` (idempotent); ``version_of`` is the snapshot served."""
    original = tokenizer_manager.generate_request
    if getattr(original, "_delta_swap_instrumented", False):
        return

    async def generate_request(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if args:
            salt(args[0], version_of())
        recorder = current_recorder()
        async for item in original(*args, **kwargs):
            if recorder is not None:
                batch = item if isinstance(item, list) else [item]
                for position, out in enumerate(batch):
                    meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
                    if meta.get("finish_reason") is not None:
                        index = position if isinstance(item, list) else out.get("index", 0)
                        record(index, meta.get("weight_versions") or [])
            yield item

    generate_request._delta_swap_instrumented = True  # type: ignore[attr-defined]
    tokenizer_manager.generate_request = generate_request
