"""Wrap vLLM's ``engine_client.generate``, which every route calls once per prompt, so that:

* the weight-version spans of every choice reach delta-swap's middleware on the OpenAI-compatible
  routes (vLLM's output processor tracks, per request, which weight version produced each token
  range and puts the spans on the final output, ``CompletionOutput.weight_versions``; vLLM 0.32
  serializes them only on its token-in/token-out route): :func:`delta_swap.version_tags.record`,
  choice index = prompt number x n + output index;
* every request's prefix-cache salt includes the snapshot served when it was admitted, so no new
  request ever reuses KV computed with other weights, even when requests kept in place during a
  swap hold old blocks and the prefix cache cannot be reset.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from delta_swap.version_tags import current_recorder, record


def salted(prompt: Any, version: str | None) -> Any:
    """``prompt`` with ``version`` added to its prefix-cache salt (dict prompts and engine requests)."""
    if not version:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": version}
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        return {**prompt, "cache_salt": f"{salt}|{version}" if salt else version}
    if hasattr(prompt, "cache_salt"):
        salt = prompt.cache_salt
        prompt.cache_salt = f"{salt}|{version}" if salt else version
    return prompt


def instrument(engine_client: Any, version_of: Callable[[], str | None]) -> None:
    """Wrap ``engine_client.generate`` (idempotent); ``version_of`` is the snapshot served now."""
    original = engine_client.generate
    if getattr(original, "_delta_swap_instrumented", False):
        return

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if args:
            args = (salted(args[0], version_of()), *args[1:])
        elif "prompt" in kwargs:
            kwargs["prompt"] = salted(kwargs["prompt"], version_of())
        recorder = current_recorder()
        call = recorder.next_call() if recorder is not None else 0
        async for output in original(*args, **kwargs):
            if recorder is not None and getattr(output, "finished", False):
                outputs = list(getattr(output, "outputs", None) or [])
                for choice in outputs:
                    record(call * len(outputs) + choice.index, getattr(choice, "weight_versions", None) or [])
            yield output

    generate._delta_swap_instrumented = True  # type: ignore[attr-defined]
    engine_client.generate = generate
