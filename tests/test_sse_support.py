"""The test clients' SSE reader: lines end only at CR, LF or CRLF, wherever the chunks are cut."""

import asyncio
import json

from tests.support.sse import asse_lines, data_documents, sse_lines

DOC = {"choices": [{"text": "a\u2028b\x85c\u2029d\x1ce"}]}
STREAM = "data: " + json.dumps(DOC, ensure_ascii=False) + "\r\n\r\n" + "data: [DONE]\n\n"


def test_unicode_separators_inside_a_document_do_not_end_its_line_at_any_cut() -> None:
    for cut in range(len(STREAM) + 1):
        assert list(data_documents(sse_lines([STREAM[:cut], STREAM[cut:]]))) == [DOC], cut


def test_the_async_reader_gives_the_same_lines() -> None:
    async def chunks():
        for i in range(0, len(STREAM), 5):
            yield STREAM[i : i + 5]

    async def read() -> list[str]:
        return [line async for line in asse_lines(chunks())]

    assert asyncio.run(read()) == list(sse_lines([STREAM]))
    assert list(sse_lines([STREAM])) == ["data: " + json.dumps(DOC, ensure_ascii=False), "", "data: [DONE]", ""]
