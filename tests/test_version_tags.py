"""The weight-version middleware on OpenAI-shaped responses, JSON and event streams.

The routes here are a FastAPI stand-in that answers like vLLM's and SGLang's completion routes and
records spans the way the engine hooks do; the engine test modules check the real routes.
"""

from __future__ import annotations

import json

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from delta_swap.version_tags import WeightVersionMiddleware, record


def _app(version: str = "step-0000000007") -> FastAPI:
    app = FastAPI()
    app.add_middleware(WeightVersionMiddleware, current_version=lambda: version)

    @app.post("/v1/completions")
    async def completions(body: dict):
        for i in range(body.get("n", 1)):
            if i == 1:  # choice 1 crossed a swap (keep mode)
                record(
                    i,
                    [
                        {"version": "step-0000000007", "start": 0, "end": 3},
                        {"version": "step-0000000008", "start": 3, "end": 5},
                    ],
                )
            elif body.get("report", True):
                record(i, [{"version": "step-0000000007", "start": 0, "end": 5}])
        choices = [{"index": i, "text": "hello", "finish_reason": "length"} for i in range(body.get("n", 1))]
        if not body.get("stream"):
            return {"id": "cmpl-1", "object": "text_completion", "choices": choices}

        async def events():
            for c in choices:
                yield f"data: {json.dumps({'choices': [{**c, 'finish_reason': None}]})}\n\n"
                yield f"data: {json.dumps({'choices': [{**c, 'text': ''}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"ok": True}

    return app


async def _post(app: FastAPI, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
        return await client.post("/v1/completions", json=body)


async def test_json_responses_carry_spans_per_choice_and_headers() -> None:
    r = await _post(_app(), {"n": 2})
    choices = r.json()["choices"]
    assert choices[0]["weight_versions"] == [{"version": "step-0000000007", "start": 0, "end": 5}]
    assert [s["version"] for s in choices[1]["weight_versions"]] == ["step-0000000007", "step-0000000008"]
    assert r.headers["x-weight-version"] == "step-0000000008"
    assert json.loads(r.headers["x-weight-versions"])[1][1]["start"] == 3
    assert int(r.headers["content-length"]) == len(r.content)


async def test_without_engine_spans_the_admitted_version_stands_in() -> None:
    r = await _post(_app("step-0000000042"), {"report": False})
    assert r.json()["choices"][0]["weight_versions"] == [{"version": "step-0000000042", "start": 0, "end": None}]
    assert r.headers["x-weight-version"] == "step-0000000042"


async def test_streams_get_a_header_and_spans_on_each_finishing_chunk() -> None:
    r = await _post(_app(), {"n": 2, "stream": True})
    assert r.headers["x-weight-version"] == "step-0000000007"
    events = [json.loads(line[5:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    finishing = [c for e in events for c in e["choices"] if c["finish_reason"]]
    running = [c for e in events for c in e["choices"] if not c["finish_reason"]]
    assert len(finishing) == 2 and all("weight_versions" in c for c in finishing)
    assert not any("weight_versions" in c for c in running)
    assert finishing[1]["weight_versions"][-1]["version"] == "step-0000000008"
    assert r.text.rstrip().endswith("data: [DONE]")


async def test_other_routes_pass_untouched() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://server") as client:
        r = await client.get("/health")
    assert r.json() == {"ok": True} and "x-weight-version" not in r.headers
