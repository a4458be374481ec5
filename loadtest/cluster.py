"""Per-shard capacity of the queue on a loopback Redis Cluster: the rates that bound a fleet.

    python -m loadtest.cluster [--entries 20000] [--json figures.json] [--plot FILE.png]

Starts a 3-master + 3-replica cluster (loadtest/local_cluster.py) and measures, on one shard
(one partition, whose keys share a slot), with one client connection:

- pipelined enqueue: the producer's enqueue script (id record + XADD + job counter), batches of
  1000 chunks of the built-in corpus; once plain, once confirmed with ``WAIT 1`` per batch
  (EMBEDFLEET_MIN_REPLICAS=1);
- bulk reads: XREADGROUP COUNT 1024, what a worker's reader sends;
- result write-back: the acknowledge script with fp16 result payloads (XACK + XDEL + XADD to the
  results stream + job counter), batches of 256, for vectors of dim 384, 768 and 1024;
- bytes per backlog entry: the shard's ``used_memory`` growth per enqueued chunk (stream entry
  plus its id record), and per stored result at each dimension.

Every rate is entries per second of one Python client on one shard: the client, not the Redis
thread, is the bottleneck here, so these are floors for one shard (more clients per shard go
faster until its one Redis thread is busy). ``embedfleet plan`` turns the figures into a plan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import uuid
from typing import Any

import numpy as np

from embedfleet.producer.chunker import builtin_corpus
from embedfleet.producer.enqueue import queue_enqueue
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import Chunk, Result, encode_chunk, encode_result
from embedfleet.shared.redis_conn import connect
from embedfleet.sinks.sink import Delivery, queue_acknowledgements
from loadtest.common import add_plot_argument, cpu_name
from loadtest.local_cluster import LocalCluster

DIMS = (384, 768, 1024)
ENQUEUE_BATCH = 1000
READ_COUNT = 1024
WRITE_BATCH = 256


def _chunks(count: int) -> list[Chunk]:
    corpus = list(builtin_corpus(2000))
    return [
        Chunk(f"c{i}-{uuid.uuid4().hex[:8]}", corpus[i % len(corpus)].text, job="cap")
        for i in range(count)
    ]


async def _used_memory(client: Any, key: str) -> int:
    node = client.get_node_from_key(key)
    info = await client.info("memory", target_nodes=node)
    return int(info["used_memory"])


async def _enqueue_rate(
    client: Any, keys: Keys, payloads: list[tuple[str, bytes]], confirm_on: Any = None
) -> int:
    """Entries/s of the producer's enqueue script, pipelined in batches of ENQUEUE_BATCH; with
    ``confirm_on`` (the stream's node), every batch also waits for one replica (``WAIT 1``)."""
    started = time.perf_counter()
    for start in range(0, len(payloads), ENQUEUE_BATCH):
        pipe = client.pipeline(transaction=False)
        queue_enqueue(
            pipe,
            stream=keys.ingest,
            counters=keys.job("cap"),
            id_record=keys.job_ids("cap"),
            chunks=payloads[start : start + ENQUEUE_BATCH],
            id_record_ttl_s=0,
        )
        if confirm_on is not None:
            pipe.execute_command("WAIT", 1, 2000, target_nodes=confirm_on)
        replies = await pipe.execute()
        if confirm_on is not None:
            assert int(replies[-1]) >= 1, "the replica did not confirm"
    return round(len(payloads) / (time.perf_counter() - started))


async def measure(cluster: LocalCluster, entries: int) -> dict[str, Any]:
    client = connect(cluster.url)
    keys = Keys(namespace=f"cap{uuid.uuid4().hex[:6]}", partitions=3).partition(0)
    figures: dict[str, Any] = {"entries": entries}
    try:
        await client.xgroup_create(keys.ingest, keys.group, id="0", mkstream=True)
        chunks = _chunks(entries)
        payloads = [(chunk.id, encode_chunk(chunk)) for chunk in chunks]
        figures["chunk_payload_bytes"] = round(float(np.mean([len(p) for _, p in payloads])), 1)

        # --- enqueue, plain and confirmed by one replica ---------------------------------
        memory_before = await _used_memory(client, keys.ingest)
        figures["enqueue_per_s"] = await _enqueue_rate(client, keys, payloads)
        memory_after = await _used_memory(client, keys.ingest)
        figures["bytes_per_backlog_entry"] = round((memory_after - memory_before) / entries)

        confirmed = Keys(namespace=keys.namespace + "w", partitions=3).partition(0)
        node = client.get_node_from_key(confirmed.ingest)
        figures["enqueue_wait1_per_s"] = await _enqueue_rate(
            client, confirmed, payloads, confirm_on=node
        )

        # --- bulk reads ----------------------------------------------------------------------
        read: list[tuple[str, str]] = []
        started = time.perf_counter()
        while len(read) < entries:
            response = await client.xreadgroup(
                keys.group, "reader", {keys.ingest: ">"}, count=READ_COUNT
            )
            for _, stream_entries in response:
                read.extend((entry_id.decode(), "cap") for entry_id, _ in stream_entries)
        figures["read_per_s"] = round(entries / (time.perf_counter() - started))

        # --- result write-back at each dimension --------------------------------------------
        rng = np.random.default_rng(0)
        per_dim = entries // len(DIMS)
        for index, dim in enumerate(DIMS):
            batch_entries = read[index * per_dim : (index + 1) * per_dim]
            vector = rng.standard_normal(dim).astype("<f2")
            results = [
                encode_result(Result(id=f"r{i}", model="m", vector=vector, job="cap"))
                for i in range(len(batch_entries))
            ]
            memory_before = await _used_memory(client, keys.results)
            started = time.perf_counter()
            for start in range(0, len(batch_entries), WRITE_BATCH):
                pipe = client.pipeline(transaction=True)
                deliveries = [
                    Delivery(keys.ingest, entry_id, job)
                    for entry_id, job in batch_entries[start : start + WRITE_BATCH]
                ]
                queue_acknowledgements(
                    pipe, keys, deliveries, "done", payloads=results[start : start + WRITE_BATCH]
                )
                await pipe.execute()
            seconds = time.perf_counter() - started
            memory_after = await _used_memory(client, keys.results)
            figures[f"write_dim{dim}_per_s"] = round(len(batch_entries) / seconds)
            figures[f"write_dim{dim}_mb_per_s"] = round(
                len(batch_entries) * len(results[0]) / seconds / 1e6, 1
            )
            figures[f"result_dim{dim}_payload_bytes"] = len(results[0])
            # acknowledged entries are deleted, so the memory change is the results' growth
            # minus the stream entries freed: add those back at the measured size per entry
            freed = len(batch_entries) * figures["bytes_per_backlog_entry"]
            figures[f"bytes_per_result_dim{dim}"] = round(
                (memory_after - memory_before + freed) / len(batch_entries)
            )
    finally:
        await client.aclose()
    return figures


def table(figures: dict[str, Any]) -> str:
    rows = [
        ("pipelined enqueue (script, batches of 1000)", f"{figures['enqueue_per_s']:,}/s"),
        ("  confirmed by 1 replica (WAIT 1 per batch)", f"{figures['enqueue_wait1_per_s']:,}/s"),
        ("bulk reads (XREADGROUP COUNT 1024)", f"{figures['read_per_s']:,}/s"),
    ]
    for dim in DIMS:
        rows.append(
            (
                f"result write-back, fp16 dim {dim} (ack script, batches of 256)",
                f"{figures[f'write_dim{dim}_per_s']:,}/s "
                f"({figures[f'write_dim{dim}_mb_per_s']} MB/s)",
            )
        )
    rows.append(
        (
            "memory per backlog entry (stream entry + id record)",
            f"{figures['bytes_per_backlog_entry']:,} B "
            f"(payload {figures['chunk_payload_bytes']:,} B)",
        )
    )
    for dim in DIMS:
        rows.append(
            (f"memory per stored result, dim {dim}", f"{figures[f'bytes_per_result_dim{dim}']:,} B")
        )
    lines = ["| per shard, one client | measured |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    add_plot_argument(parser, "the rates and memory per entry")
    args = parser.parse_args()
    with LocalCluster(masters=3, replicas_per_master=1) as cluster:
        figures = asyncio.run(measure(cluster, args.entries))
    figures["cpu"] = cpu_name()
    figures["redis_server"] = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True
    ).stdout.strip()
    print(table(figures))
    print(f"\nCPU: {figures['cpu']}; {figures['redis_server']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    if args.plot is not None:
        from loadtest.plots import plot_cluster

        subtitle = (
            f"one partition (shard) of a loopback 3+3 cluster, {args.entries:,} entries; "
            f"{figures['cpu']}, {figures['redis_server'].split(' sha=')[0]}"
        )
        print(f"chart: {plot_cluster(figures, args.plot, subtitle, DIMS)}")


if __name__ == "__main__":
    main()
