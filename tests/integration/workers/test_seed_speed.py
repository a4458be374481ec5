"""The bulk slice cost's seed (workers/slices.py, ``Slices.seed_speed``): probe batches timed
once per loaded model, bulk path and torch threads in a process; a second worker over the same
encoder seeds its cost model from those times instead of timing the batches again."""

from __future__ import annotations

import asyncio

import pytest
import torch

from embedfleet.shared.settings import Settings
from embedfleet.workers import slices
from embedfleet.workers.model.encoder import Encoder
from tests.conftest import WorkerLauncher


async def test_a_second_worker_over_one_encoder_reuses_the_probe_times(
    workers: WorkerLauncher, settings: Settings, encoder: Encoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(slices._SEEDS, encoder, raising=False)  # earlier tests' times forgotten
    timed: list[int] = []  # torch threads at each time the probes were timed
    time_probes = slices.Slices._time_probes

    async def counted(self: slices.Slices, *args: object) -> object:
        timed.append(torch.get_num_threads())
        return await time_probes(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(slices.Slices, "_time_probes", counted)
    threads = torch.get_num_threads()
    fitted = []
    for wanted in (threads, threads, threads + 1):
        torch.set_num_threads(wanted)
        try:
            async with workers.run(settings, encoder=encoder) as worker:
                # seeded before the compute stage is ready, after the query stage's ready
                await asyncio.wait_for(worker.compute.ready.wait(), 300)
                path = worker.slices.bulk_path()
                fitted.append(str(worker.slices.slice_costs[path].cost))
        finally:
            torch.set_num_threads(threads)
    # timed by the first worker and again on another thread count, not by the second worker
    assert timed == [threads, threads + 1]
    # the second worker's cost model starts from the first's times
    assert fitted[1] == fitted[0]
    # kept by path and thread count, one set of three probe times each
    kept = slices._SEEDS[encoder]
    assert set(kept) == {(path, threads), (path, threads + 1)}
    samples = kept[(path, threads)]
    assert len(samples) == 3 and all(seconds > 0 for _, seconds in samples)
