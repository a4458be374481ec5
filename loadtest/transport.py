"""The floor under the query stream: the same `embed_query` round trip with no model.

    python -m loadtest.transport [--queries 150]

A model-free consumer (its own process, like a worker) answers each query with a zero vector
through the same keys and commands the worker uses: XREADGROUP on the query stream, then one
MULTI with RPUSH + EXPIRE on the reply key and XACK + XDEL. The caller is the real
`Producer.embed_query`. Three states are measured, interleaved: back to back; right after a
forward pass of the model in the calling process (the caches are full of weights); after a
30 ms pause (idle vCPUs). The idle-gap target of issue 4 cannot go below these.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
import uuid

import numpy as np
import uvloop

from embedfleet.producer import Producer
from embedfleet.shared.protocol import PAYLOAD_FIELD, Result, decode_chunk, encode_result
from embedfleet.shared.redis_conn import connect, ensure_groups
from embedfleet.shared.settings import Settings
from loadtest.common import percentile_ms, redis_server
from loadtest.latency import QUERY


def echo_consumer(url: str, namespace: str, dimension: int) -> None:
    """Answers every query with a zero vector, the way a worker's query stage answers."""

    async def serve() -> None:
        settings = Settings(redis_url=url, namespace=namespace)
        keys = settings.keys
        client = connect(url)
        await ensure_groups(client, keys)
        zeros = np.zeros(dimension, dtype="<f2")
        while True:
            response = await client.xreadgroup(
                keys.group, "echo", {keys.query: ">"}, count=64, block=5000
            )
            for _stream, entries in response or []:
                for entry_id, fields in entries:
                    chunk = decode_chunk(fields[PAYLOAD_FIELD])
                    reply_key = keys.reply(chunk.reply or "")
                    result = Result(id=chunk.id, model="echo", vector=zeros, truncated=False)
                    pipe = client.pipeline(transaction=True)
                    pipe.rpush(reply_key, encode_result(result))
                    pipe.expire(reply_key, settings.reply_ttl_s)
                    pipe.xack(keys.query, keys.group, entry_id)
                    pipe.xdel(keys.query, entry_id)
                    await pipe.execute()

    uvloop.run(serve())


async def timed_query(producer: Producer) -> float:
    started = time.perf_counter()  # not loop.time(): uvloop's clock ticks in milliseconds
    await producer.embed_query(QUERY, timeout=30)
    return time.perf_counter() - started


async def scenario(queries: int) -> None:
    from embedfleet.workers.model.encoder import Encoder

    encoder = Encoder()
    for _ in range(10):
        encoder.embed_texts([QUERY])
    states = ("back to back", "after a forward pass", "after 30 ms")
    rows: dict[str, list[float]] = {state: [] for state in states}
    with redis_server() as server:
        settings = Settings(redis_url=server.url, namespace=f"echo{uuid.uuid4().hex[:6]}")
        echo = multiprocessing.get_context("spawn").Process(
            target=echo_consumer, args=(server.url, settings.namespace, 384), daemon=True
        )
        echo.start()
        try:
            async with Producer(settings) as producer:
                for _ in range(50):  # warm both sides
                    await timed_query(producer)
                for _ in range(queries):
                    rows["back to back"].append(await timed_query(producer))
                    encoder.embed_texts([QUERY])
                    rows["after a forward pass"].append(await timed_query(producer))
                    await asyncio.sleep(0.03)
                    rows["after 30 ms"].append(await timed_query(producer))
        finally:
            echo.kill()
    print(f"# embed_query round trip with a model-free consumer ({queries} queries per row)")
    print("| state | p50 ms | p99 ms |")
    print("|---|---|---|")
    for state, samples in rows.items():
        print(f"| {state} | {percentile_ms(samples, 50):.2f} | {percentile_ms(samples, 99):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queries", type=int, default=150, help="queries per row")
    uvloop.run(scenario(parser.parse_args().queries))


if __name__ == "__main__":
    main()
