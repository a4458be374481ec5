"""N model replicas in one worker: N processes under this one, reading the same group.

On a GPU a small embedder leaves the device mostly idle from one process (the seed's lesson:
32 replicas of a small model per H200); on a CPU, N replicas with threads/N each trade one
model's intra-op parallelism for N models' overlap of tokenizing, Redis and Python work. Either
way the replicas are plain workers: consumers ``<consumer>-r0``..``-r{N-1}`` of the same group,
each with its share of the threads (one each on CUDA) and its own health port (the base port +
its index), so the group, reclaim and drain work exactly as for separate pods. On CUDA each also
gets a share of the GPU's memory (EMBEDFLEET_GPU_MEMORY_FRACTION, auto 1/N), so that one
replica's long-text batch cannot take the memory another one is about to need.

The parent only supervises: the first SIGTERM/SIGINT is passed on (every replica drains), a
second is passed on too (every replica exits at once). A replica that exits on its own while
the others run means this worker is no longer whole: the others are drained and the parent
exits non-zero, so the supervisor restarts the pod rather than running a fraction of it.

How many: EMBEDFLEET_REPLICAS, ``auto`` by default (:func:`replicas_for`): one on a CPU, and on
CUDA as many as the host's usable cores can feed, one per :data:`CORES_PER_GPU_REPLICA`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from embedfleet.shared.logging import configure_logging, get_logger
from embedfleet.shared.settings import Settings
from embedfleet.workers.cpus import usable_cpus

log = get_logger("embedfleet.replicas")


# What a CUDA process holds on the device outside PyTorch's caching allocator, which is all that
# set_per_process_memory_fraction caps: the context and loaded kernel modules (~0.5 GiB on
# Hopper with lazy loading), with a margin.
CUDA_CONTEXT_BYTES = 1 << 30


# Host cores one GPU worker process keeps busy, for EMBEDFLEET_REPLICAS=auto. The GPU check's host
# step (docs/BENCHMARKS.md, "GPU check", stop 50: an H200 on a 16-core Intel Xeon) measured one
# worker process's host pipeline at 1.21 cores (read, decode, tokenize, plan, collate, write,
# with a stand-in model at zero cost); the real model adds the thread that launches its kernels
# and waits for the copy back, and Redis and the node's own daemons share the cores: 1.5 leaves
# them that margin. 16 usable cores give 10 replicas, stop 50's estimate of what it takes to feed
# the GPU (8 to 10 processes at 267k tokens/s each).
CORES_PER_GPU_REPLICA = 1.5
# Past this each process's share of the GPU's memory (less its ~1 GiB CUDA context) gets too
# small for a long-text batch on an 80 GB card, and time-slicing more contexts gains nothing the
# measured host rate calls for. Below the setting's own bound (64), which an explicit N may use.
MAX_AUTO_REPLICAS = 16


def replicas_for(setting: int | Literal["auto"], *, on_cuda: bool, cpus: int) -> int:
    """The worker processes EMBEDFLEET_REPLICAS asks for: an integer as given; ``auto`` 1 on a
    CPU (its cores are worth more to one model's intra-op threads: docs/BENCHMARKS.md,
    "Replicas"), on CUDA one per CORES_PER_GPU_REPLICA of the ``cpus`` usable, 1 to
    MAX_AUTO_REPLICAS."""
    if setting != "auto":
        return setting
    if not on_cuda:
        return 1
    return max(1, min(MAX_AUTO_REPLICAS, int(cpus / CORES_PER_GPU_REPLICA)))


def runs_on_cuda(settings: Settings) -> bool:
    """Whether this worker's model runs on CUDA (``auto``: when torch sees a GPU). Imports torch
    only for ``auto``: a CPU worker's supervisor never pays for it."""
    return settings.device == "cuda" or (settings.device == "auto" and _cuda_available())


def resolve_replicas(settings: Settings) -> int:
    """EMBEDFLEET_REPLICAS for this host: :func:`replicas_for` on this machine's device and
    usable cores (the affinity mask and cgroup quota: a pod's CPU limit, not the node's cores)."""
    if settings.replicas != "auto":
        return settings.replicas
    return replicas_for("auto", on_cuda=runs_on_cuda(settings), cpus=usable_cpus())


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    consumer: str
    threads: int
    health_port: int
    gpu_memory_share: float = 0.0  # of the device's memory; 0 = no cap


def gpu_memory_share(setting: float, replicas: int) -> float:
    """The share of the GPU's memory each of ``replicas`` processes gets; 0 = no cap.
    ``setting`` is EMBEDFLEET_GPU_MEMORY_FRACTION: -1 (auto) = 1/replicas, none for one."""
    if setting == -1:
        return 1 / replicas if replicas > 1 else 0.0
    return setting


def allocator_fraction(share: float, device_bytes: int) -> float | None:
    """The caching allocator's cap for a process with ``share`` of a ``device_bytes`` GPU: the
    share less the context's memory outside the allocator. None: no cap."""
    if share <= 0 or share >= 1:
        return None
    fraction = share - CUDA_CONTEXT_BYTES / device_bytes
    if fraction <= 0:
        raise ValueError(
            f"a GPU memory share of {share:.3f} ({share * device_bytes / 2**30:.1f} GiB) leaves "
            f"nothing beside the CUDA context (~{CUDA_CONTEXT_BYTES / 2**30:.0f} GiB): run fewer "
            "replicas per GPU or raise EMBEDFLEET_GPU_MEMORY_FRACTION"
        )
    return fraction


def limit_gpu_memory(share: float, device: object) -> float | None:
    """Cap this process's allocator at its share of the GPU (a CUDA ``device`` only); the
    fraction set, or None."""
    import torch

    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = allocator_fraction(share, total)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        log.info("GPU memory capped", share=round(share, 4), allocator_fraction=round(fraction, 4))
    return fraction


def plan_replicas(settings: Settings, replicas: int, on_cuda: bool) -> list[ReplicaPlan]:
    """Each replica's consumer name, thread share, health port and (CUDA) GPU memory share."""
    threads = 1 if on_cuda else max(1, (settings.threads or usable_cpus()) // replicas)
    share = gpu_memory_share(settings.gpu_memory_fraction, replicas) if on_cuda else 0.0
    return [
        ReplicaPlan(
            index=index,
            consumer=f"{settings.consumer}-r{index}",
            threads=threads,
            health_port=settings.health_port + index if settings.health_port else 0,
            gpu_memory_share=share,
        )
        for index in range(replicas)
    ]


def replica_environment(plan: ReplicaPlan, overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment, the CLI's overrides, and the replica's own settings."""
    return {
        **os.environ,
        **overrides,
        "EMBEDFLEET_REPLICAS": "1",
        "EMBEDFLEET_CONSUMER": plan.consumer,
        "EMBEDFLEET_THREADS": str(plan.threads),
        "EMBEDFLEET_HEALTH_PORT": str(plan.health_port),
        # the share itself: a replica sees REPLICAS=1, where auto would mean no cap
        "EMBEDFLEET_GPU_MEMORY_FRACTION": repr(plan.gpu_memory_share),
    }


def run_replicas(settings: Settings, overrides: Mapping[str, str], replicas: int) -> int:
    """Start ``replicas`` worker processes (``resolve_replicas``) and supervise them; the exit
    status."""
    configure_logging(settings.log_level, settings.log_format)  # the replicas' stream: stderr
    plans = plan_replicas(settings, replicas, runs_on_cuda(settings))
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "embedfleet.cli", "worker"],
            env=replica_environment(plan, overrides),
            # Their own process group: a terminal's Ctrl-C reaches the parent alone, which passes
            # it on once (a replica that got it twice would abort instead of draining).
            process_group=0,
        )
        for plan in plans
    ]
    log.info(
        "replicas started",
        replicas=len(children),
        setting=settings.replicas,  # "auto": sized from the host's cores (replicas_for)
        usable_cpus=usable_cpus(),
        threads_each=plans[0].threads,
        gpu_memory_share=round(plans[0].gpu_memory_share, 4),
        consumers=[plan.consumer for plan in plans],
    )
    signalled = False

    def pass_on(signum: int, _frame: object) -> None:
        nonlocal signalled
        signalled = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = 0
        running = set(range(len(children)))
        while running:
            pid, wait_status = os.wait()
            index = next((i for i in running if children[i].pid == pid), None)
            if index is None:
                continue
            running.discard(index)
            code = os.waitstatus_to_exitcode(wait_status)
            children[index].returncode = code
            if code != 0 or not signalled:
                status = status or (code if code > 0 else 1)
                if not signalled:
                    log.error(
                        "a replica exited on its own; draining the others",
                        consumer=plans[index].consumer,
                        exit_code=code,
                    )
                    pass_on(signal.SIGTERM, None)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
