"""The HTTP gateway's cost: single-input latency through `embedfleet serve` vs the query stream
called directly (Producer.embed_query), idle and under a bulk backlog, and requests/s.

    python -m loadtest.gateway [--requests 200] [--backlog 4000] [--concurrency 16] [--seconds 10]

One Redis server, one `embedfleet worker` process and one `embedfleet serve` process (uvicorn,
one process), all on this machine. Gateway and direct requests alternate one by one, so both
sides see the same machine load; requests/s runs each side alone for --seconds with
--concurrency clients in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

import httpx

from embedfleet.producer.chunker import builtin_corpus
from embedfleet.producer.client import Producer
from embedfleet.server import free_port
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from loadtest.common import (
    cpu_name,
    embedfleet_process,
    machine_load,
    percentile_ms,
    redis_server,
    worker_process,
)

QUERY = "how do I open a file for reading in Python?"
MODEL = "all-MiniLM-L6-v2"


@contextlib.contextmanager
def gateway_process(settings: Settings, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """`embedfleet serve` as its own process, stopped with SIGTERM on exit."""
    environment = {
        "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
        "EMBEDFLEET_NAMESPACE": settings.namespace,
        "EMBEDFLEET_GATEWAY_PORT": str(port),
        "EMBEDFLEET_FILES_DIR": f"/tmp/embedfleet-loadtest-files-{port}",
        "EMBEDFLEET_LOG_LEVEL": "warning",
        "EMBEDFLEET_BACKLOG_HIGH_WATER": "10000000",  # the backlog phase is meant to be over it
    }
    with embedfleet_process("serve", environment, stop_timeout_s=30) as process:
        yield process


async def wait_ready(http: httpx.AsyncClient, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.TransportError):
            if (await http.get("/health")).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError("gateway or worker not ready")
        await asyncio.sleep(0.2)


def via_gateway(http: httpx.AsyncClient) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        response = await http.post(
            "/v1/embeddings",
            json={"model": MODEL, "input": QUERY, "encoding_format": "base64"},
        )
        response.raise_for_status()

    return call


def via_query_stream(producer: Producer) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        await producer.embed_query(QUERY, timeout=30)

    return call


async def paired(
    gateway: Callable[[], Awaitable[None]], direct_call: Callable[[], Awaitable[None]], count: int
) -> tuple[list[float], list[float]]:
    """Alternate gateway and direct requests, one at a time."""
    through_gateway: list[float] = []
    direct: list[float] = []
    for _ in range(count):
        for call, samples in ((gateway, through_gateway), (direct_call, direct)):
            started = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - started)
    return through_gateway, direct


async def throughput(
    call: Callable[[], Awaitable[None]], concurrency: int, seconds: float
) -> float:
    done = 0
    stop_at = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await call()
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.monotonic() - started)


def bulk_chunks(count: int) -> list[Chunk]:
    texts = [c.text for c in builtin_corpus()]
    return [
        Chunk(id=f"bulk-{uuid.uuid4().hex[:6]}-{i}", text=texts[i % len(texts)])
        for i in range(count)
    ]


def row(name: str, samples: list[float]) -> str:
    return (
        f"| {name} | {len(samples)} | {percentile_ms(samples, 50):.1f} | "
        f"{percentile_ms(samples, 99):.1f} |"
    )


async def scenario(args: argparse.Namespace) -> None:
    with redis_server() as server:
        settings = Settings(redis_url=server.url, namespace=f"lg{uuid.uuid4().hex[:6]}")
        port = free_port()
        worker_env = {} if args.frozen else {"EMBEDFLEET_FROZEN_QUERIES": "false"}
        with worker_process(settings, "lg-worker", **worker_env), gateway_process(settings, port):
            limits = httpx.Limits(max_connections=args.concurrency * 2)
            async with (
                httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits
                ) as http,
                Producer(settings) as producer,
            ):
                await wait_ready(http)
                gateway, direct_call = via_gateway(http), via_query_stream(producer)
                await paired(gateway, direct_call, 20)  # warm up both paths
                idle_gateway, idle_direct = await paired(gateway, direct_call, args.requests)
                gateway_rps = await throughput(gateway, args.concurrency, args.seconds)
                direct_rps = await throughput(direct_call, args.concurrency, args.seconds)
                await producer.enqueue(bulk_chunks(args.backlog), job="backlog")
                await asyncio.sleep(1.0)  # the worker is deep in bulk batches
                busy_gateway, busy_direct = await paired(gateway, direct_call, args.requests)
                left = await producer.progress("backlog")
                backlog_left = left.enqueued - left.done - left.dead
    print(f"CPU: {cpu_name()}; {machine_load()}")
    print(
        f"python -m loadtest.gateway --requests {args.requests} --backlog {args.backlog} "
        f"--concurrency {args.concurrency} --seconds {args.seconds}"
        + ("" if args.frozen else " --no-frozen")
    )
    print("\n| single input | requests | p50 ms | p99 ms |\n|---|---|---|---|")
    print(row("idle: gateway (POST /v1/embeddings)", idle_gateway))
    print(row("idle: query stream direct (embed_query)", idle_direct))
    print(row("bulk backlog: gateway", busy_gateway))
    print(row("bulk backlog: query stream direct", busy_direct))
    print(f"\nbacklog still queued after the busy phase: {backlog_left} of {args.backlog}")
    print(
        f"requests/s, {args.concurrency} in flight, idle, {args.seconds:.0f} s each: "
        f"gateway {gateway_rps:.1f}, query stream direct {direct_rps:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="paired requests per phase")
    parser.add_argument("--backlog", type=int, default=4000, help="bulk chunks for the busy phase")
    parser.add_argument("--concurrency", type=int, default=16, help="clients for requests/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each req/s run")
    parser.add_argument(
        "--no-frozen", dest="frozen", action="store_false", help="queries eager on the worker"
    )
    asyncio.run(scenario(parser.parse_args()))


if __name__ == "__main__":
    main()
