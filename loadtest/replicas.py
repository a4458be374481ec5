"""Model replicas on one machine: ``python -m loadtest.replicas [--replicas 1,2] [--texts 1000]``.

For each N, one ``embedfleet worker`` with ``EMBEDFLEET_REPLICAS=N`` (N processes with
threads/N each) embeds the benchmark corpus from a real server, end to end, with the default
settings otherwise; the clock runs from the first enqueue to the job's last result, after every
replica's /readyz says its model is loaded. Rounds are interleaved (1, 2, ..., then 2, 1, ...)
and the table quotes the median texts/s and the median per-round ratio to N = 1.
"""

from __future__ import annotations

import asyncio
import random
import socket
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import aiohttp
import click

from embedfleet.producer.client import Producer
from embedfleet.shared.settings import Settings
from embedfleet.workers.cpus import usable_cpus
from loadtest.bench import machine_line
from loadtest.common import redis_server, worker_process
from loadtest.corpus import build_corpus


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it (the replicas' health ports), below the
    kernel's ephemeral range: a port found free there stays free until a replica binds it
    (a model load later), while one in the ephemeral range may meanwhile become the source
    port of any outgoing connection on the machine (a CI run had a replica's health port
    taken so, and waited its whole timeout for a /readyz that never came)."""
    low, _ = ephemeral_port_range()
    first = min(FIRST_FIXED_PORT, low - count - 1)
    while True:
        base = random.randrange(first, low - count)
        try:
            for offset in range(count):
                with socket.socket() as taken:
                    taken.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base


# where free_ports looks, up to the ephemeral range (Linux's default starts at 32768)
FIRST_FIXED_PORT = 20000


def ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


async def wait_ready(
    ports: list[int], timeout: float = 600, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Until every replica's /readyz says 200 (model loaded, Redis answers, a forward pass
    works). A consumer shows in XINFO CONSUMERS only once it has read something, so the group
    cannot tell an idle replica from a missing one. With ``process`` (the replicas' parent),
    raises as soon as it has exited: its replicas will never be ready."""
    async with aiohttp.ClientSession() as session, asyncio.timeout(timeout):
        for port in ports:
            while True:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(
                        f"the worker exited ({process.returncode}) before replica port {port} "
                        "was ready"
                    )
                try:
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)


def one_run(url: str, replicas: int, chunks: list[dict[str, str]]) -> float:
    """Seconds for ``replicas`` replicas to embed ``chunks``, model loads not counted."""
    settings = Settings(redis_url=url, namespace=f"rep{uuid.uuid4().hex[:8]}")
    port = free_ports(replicas)
    with worker_process(
        settings, "bench", EMBEDFLEET_REPLICAS=str(replicas), EMBEDFLEET_HEALTH_PORT=str(port)
    ):
        asyncio.run(wait_ready([port + i for i in range(replicas)]))
        return asyncio.run(_timed(settings, chunks))


async def _timed(settings: Settings, chunks: list[dict[str, str]]) -> float:
    async with Producer(settings) as producer:
        started = time.perf_counter()
        await producer.enqueue(chunks, job="replicas")
        progress = await producer.wait_for_job("replicas", timeout=3600)
        seconds = time.perf_counter() - started
    if progress.done != len(chunks):
        raise RuntimeError(f"only {progress.done} of {len(chunks)} chunks were embedded")
    return seconds


@click.command()
@click.option("--replicas", "counts", default="1,2", show_default=True, help="N to compare.")
@click.option("--texts", "count", type=int, default=1000, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
def main(counts: str, count: int, rounds: int) -> None:
    """Texts/s of one worker with N model replicas, end to end, interleaved rounds."""
    replica_counts = [int(n) for n in counts.split(",")]
    chunks = [{"id": item.id, "text": item.text} for item in build_corpus(count)]
    rates: dict[int, list[float]] = {n: [] for n in replica_counts}
    with redis_server() as server:
        for number in range(rounds):
            shift = number % len(replica_counts)
            for replicas in replica_counts[shift:] + replica_counts[:shift]:
                seconds = one_run(server.url, replicas, chunks)
                rates[replicas].append(count / seconds)
                print(f"round {number + 1}: {replicas} replicas {count / seconds:.1f} texts/s")
    base = rates[replica_counts[0]]
    print(f"machine: {machine_line()}")
    print(f"corpus: {count} texts; {rounds} rounds interleaved; default settings otherwise")
    print("| replicas | threads each | texts/s (median) | × 1 replica (median of rounds) |")
    print("|---:|---:|---:|---:|")
    threads = Settings().threads or usable_cpus()
    for replicas in replica_counts:
        ratio = statistics.median(r / b for r, b in zip(rates[replicas], base, strict=True))
        print(
            f"| {replicas} | {max(1, threads // replicas)} | "
            f"{statistics.median(rates[replicas]):.1f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
