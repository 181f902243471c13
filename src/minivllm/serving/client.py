"""The other end of the wire: streaming clients that time what they receive (chapter 09).

A server's latency is what its clients see, so it is measured on their side of the socket:

* **TTFT**, time to first token: from sending the request to the first chunk that carries text (the
  wait in the queue, the prefill, and one trip through the event loop);
* **ITL**, inter-token latency: the gaps between a stream's consecutive text chunks (one engine step
  each, while the batch runs; more when a preemption or a long prefill holds it up).

`stream_completion` sends one streaming request to `/v1/completions` with `httpx` and reads the
Server-Sent Events as they arrive; `run_clients` runs many such clients at once, each sending its
next request when its last stream has ended (a closed loop: `concurrency` requests in flight).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import httpx

from minivllm.serving.openai_protocol import DONE


@dataclass
class StreamedCompletion:
    """One streamed request, as its client saw it (times from `time.perf_counter()`)."""

    sent: float
    # arrival of each chunk that carried text
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk, when the request asked for one

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]


def sse_payload(line: str) -> dict | None:
    """The JSON of one `data: ...` line of a Server-Sent Event stream; None for `[DONE]` and other
    lines."""
    if not line.startswith("data: ") or line == f"data: {DONE}":
        return None
    return json.loads(line[len("data: ") :])


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, body: dict
) -> StreamedCompletion:
    """POST `body` (one prompt; "stream" is set) to `{base_url}/completions` and read the stream to
    its end."""
    result = StreamedCompletion(time.perf_counter())
    async with client.stream(
        "POST", f"{base_url}/completions", json={**body, "stream": True}
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if (chunk := sse_payload(line)) is None:
                continue
            if "error" in chunk:  # the engine failed mid-stream
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                if choice["text"]:
                    result.chunk_times.append(time.perf_counter())
                    result.text += choice["text"]
                result.finish_reason = choice["finish_reason"] or result.finish_reason
            if chunk.get("usage"):
                result.completion_tokens = chunk["usage"]["completion_tokens"]
    return result


async def run_clients(
    base_url: str, bodies: SequenceOf[dict], concurrency: int, timeout: float = 600
) -> tuple[float, list[StreamedCompletion]]:
    """`concurrency` clients work through `bodies`, one request in flight each: (wall seconds,
    results in the order of `bodies`)."""
    results: list[StreamedCompletion | None] = [None] * len(bodies)
    pending = list(reversed(range(len(bodies))))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def client_loop() -> None:
            while pending:
                index = pending.pop()
                results[index] = await stream_completion(client, base_url, bodies[index])

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return time.perf_counter() - started, results


@dataclass
class Isolation:
    """Streams served beside one big non-streamed request: what the streams' clients saw, and what
    the big request's client got. `streams[i]` holds client i's streams, one after another."""

    streams: list[list[StreamedCompletion]]
    big_status: int | None = None  # None: no big request was sent
    big_bytes: int = 0
    big_seconds: float = 0.0

    @property
    def gaps(self) -> list[float]:
        """Every inter-token gap of every stream (not the time to first token: a stream sent
        while the big request holds every seat waits for one, which is the scheduler's doing, not
        a stall)."""
        return [gap for client in self.streams for stream in client for gap in stream.itls]

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)


async def streams_beside(
    base_url: str,
    stream_bodies: SequenceOf[dict],
    big_body: dict | None = None,
    big_after: float = 0.5,
    timeout: float = 600,
) -> Isolation:
    """One streaming client per body in `stream_bodies`, all at once, each streaming its body
    again and again until the big request is answered (once, without one); `big_after` seconds in
    (the streams are flowing) one more client posts `big_body` to `/completions`, not streamed,
    and reads its whole answer. Does the big answer stall the streams?"""
    limits = httpx.Limits(max_connections=len(stream_bodies) + 1)
    answered = asyncio.Event()
    if big_body is None:
        answered.set()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def big() -> tuple[int, int, float]:
            await asyncio.sleep(big_after)
            started = time.perf_counter()
            try:
                response = await client.post(f"{base_url}/completions", json=big_body)
            finally:
                answered.set()
            return response.status_code, len(response.content), time.perf_counter() - started

        async def streaming_client(body: dict) -> list[StreamedCompletion]:
            streams = [await stream_completion(client, base_url, body)]
            while not answered.is_set():
                streams.append(await stream_completion(client, base_url, body))
            return streams

        clients = [streaming_client(body) for body in stream_bodies]
        if big_body is None:
            return Isolation(list(await asyncio.gather(*clients)))
        *results, (status, size, seconds) = await asyncio.gather(*clients, big())
        return Isolation(results, status, size, seconds)
