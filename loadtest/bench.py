"""The side-by-side throughput benchmark: ``python -m loadtest.bench``.

Every contender embeds the same corpus (``loadtest.corpus``, RAG-like, skewed) with the same
number of torch threads; contenders run interleaved (A B C, B C A, ... a rotation per round) for
``--rounds`` rounds and the table quotes the median, so a machine that gets busier or quieter
during the run affects every contender alike. Contenders:

1. ``st encode(32)``: ``SentenceTransformer.encode`` in-process, batch 32: the baseline (1).
   ``st encode(best)``: the same at the batch size that won a short sweep in this run.
2. ``naive padded(32)``: tokenize and embed batches of 32 in arrival order, padded.
3. ``fleet fp32`` / ``fleet auto``: end to end: enqueue into a real Redis-compatible server
   (``embedfleet.server.ServerProcess``) → an in-process worker (as ``embedfleet demo`` runs it)
   → results on the results stream; the clock runs from the first enqueue to the last result.

``--engines`` adds in-process contenders for the forward-pass layout and precision choices
(sorted padded micro-batches vs packed rows vs varlen, fp32 vs auto; ``--compile`` adds
``torch.compile``), which is how ``workers.model.packing.preferred_layout`` and
``workers.model.precision.CPU_BF16_METHOD`` were chosen. Rows (``loadtest/packed_rows.py``) is a
contender only; varlen is the worker's own CUDA path (``workers/bulk.py``).

Per contender: texts/s, real tokens/s, padding waste, ratio to (1) (median of the per-round
ratios), and model-FLOPs utilisation: useful model FLOPs (matmuls on real tokens only:
2 x matmul parameters per token + 4 x layers x hidden x length per token for attention) over
the matmul peak of this machine in this precision, measured in the same run with a large
``torch.matmul``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # same for every contender
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import click
import numpy as np
import torch

from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.model.encoder import Encoder, Tokenized, resolve_model_path
from embedfleet.workers.model.packing import PackedEncoder
from embedfleet.workers.model.precision import cosines
from loadtest.common import cpu_name
from loadtest.corpus import build_corpus, describe, token_lengths
from loadtest.packed_rows import RowsEncoder, plan_rows
from loadtest.peers import InfinityConfig, InfinityPeer, infinity_available

ST_SWEEP = (16, 32, 64, 128, 256)


# --- results -------------------------------------------------------------------------------
@dataclass
class Run:
    """One contender's pass over the corpus."""

    seconds: float
    texts: int
    real_tokens: int
    padded_tokens: int
    vectors: np.ndarray | None = None  # (texts, dim) in corpus order, for parity
    model_busy: float | None = None  # fleet: model seconds / wall seconds


@dataclass
class Contender:
    name: str
    precision: str  # "fp32", "bf16" or "int8": which matmul peak its MFU is measured against
    run: Callable[[int], Run]  # embeds the first n texts of the corpus
    runs: list[Run] = field(default_factory=list)


@dataclass(frozen=True)
class Peak:
    fp32: float  # FLOP/s
    bf16: float

    def of(self, precision: str) -> float:
        """The peak a contender's MFU is measured against: int8 rows too against bf16's (what
        the same work would peak at without int8), so their MFU can pass 100%."""
        return self.fp32 if precision == "fp32" else self.bf16


def measure_peak(
    device: torch.device, with_bf16: bool, seconds: float = 1.0, size: int | None = None
) -> Peak:
    """The best matmul rate of a large square ``torch.matmul``, fp32 and (when the device runs
    it natively) bf16. Without native bf16 (AVX2-only CPUs) one bf16 matmul of this size takes
    minutes in emulation, and no contender runs in bf16 there anyway."""
    size = size or (8192 if device.type == "cuda" else 2048)  # large enough for the peak there
    rates = {torch.bfloat16: float("nan")}
    for dtype in (torch.float32, torch.bfloat16) if with_bf16 else (torch.float32,):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        best = 0.0
        deadline = time.perf_counter() + seconds
        for attempt in range(100):
            _sync(device)
            started = time.perf_counter()
            for _ in range(3):
                torch.matmul(a, b)
            _sync(device)
            elapsed = time.perf_counter() - started
            if attempt:  # the first call pays for kernel selection
                best = max(best, 3 * 2 * size**3 / elapsed)
            if time.perf_counter() > deadline and attempt >= 3:
                break
        rates[dtype] = best
    return Peak(fp32=rates[torch.float32], bf16=rates[torch.bfloat16])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_parameters(encoder: Encoder) -> int:
    """Weights of the linear layers inside the transformer layers (no embeddings, no pooler)."""
    layers = encoder._model.encoder.layer  # BERT-class models, which this benchmark targets
    return sum(
        module.weight.numel() for module in layers.modules() if isinstance(module, torch.nn.Linear)
    )


def useful_flops(lengths: Sequence[int], encoder: Encoder) -> float:
    """Model FLOPs for these (truncated) texts, counting real tokens only.

    Per token: 2 x matmul parameters (each weight is one multiply-add); per token per layer:
    4 x hidden x length for attention (QK^T and attention x V over the text's own length).
    """
    config = encoder._model.config
    per_token = 2 * matmul_parameters(encoder)
    attention = 4 * config.num_hidden_layers * config.hidden_size
    return float(sum(per_token * n + attention * n * n for n in lengths))


# --- contenders ----------------------------------------------------------------------------
def st_contender(model: object, texts: list[str], lengths: list[int], batch_size: int) -> Run:
    started = time.perf_counter()
    vectors = model.encode(  # type: ignore[attr-defined]
        texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False
    )
    seconds = time.perf_counter() - started
    return Run(
        seconds,
        len(texts),
        sum(lengths),
        st_padded_tokens(texts, lengths, batch_size),
        np.asarray(vectors, dtype=np.float32),
    )


def st_padded_tokens(texts: list[str], lengths: list[int], batch_size: int) -> int:
    """What sentence-transformers computes: it sorts by character length (a proxy for tokens)
    and pads each batch to its longest text in tokens."""
    order = np.argsort([-len(text) for text in texts], kind="stable")
    padded = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        padded += max(batch) * len(batch)
    return padded


def naive_contender(encoder: Encoder, texts: list[str], batch_size: int = 32) -> Run:
    """Arrival order, fixed batches, padded to the longest of each batch (fp32)."""
    started = time.perf_counter()
    vectors, real, padded = [], 0, 0
    for start in range(0, len(texts), batch_size):
        batch = encoder.collate(encoder.tokenize(texts[start : start + batch_size]))
        vectors.append(encoder.embed(batch))
        real += batch.real_tokens
        padded += batch.padded_tokens
    return Run(time.perf_counter() - started, len(texts), real, padded, np.concatenate(vectors))


def engine_contender(
    encoder: Encoder,
    texts: list[str],
    layout: str,
    window: int,
    token_budget: int,
    max_batch: int,
    frozen: bool = False,
) -> Run:
    """The worker's compute path without Redis: windows of ``window`` texts, tokenize, plan,
    embed; tokenization is inline (no overlap), as in the sentence-transformers contenders."""
    from embedfleet.workers.batcher import plan_batches, plan_packed_batches

    packer = None if layout == "padded" else _packer(encoder, layout)
    started = time.perf_counter()
    vectors = np.zeros((len(texts), encoder.dim), dtype=np.float32)
    real = padded = 0
    for base in range(0, len(texts), window):
        tokens = encoder.tokenize(texts[base : base + window])
        lengths = [t.length for t in tokens]
        if layout == "padded":
            for planned in plan_batches(lengths, token_budget, max_batch):
                batch = encoder.collate([tokens[p] for p in planned.positions])
                # frozen: the query lane's frozen, pre-packed graph (no layer hooks) for bulk too
                embed = encoder.embed_query if frozen else encoder.embed
                vectors[[base + p for p in planned.positions]] = embed(batch)
                real += batch.real_tokens
                padded += batch.padded_tokens
            continue
        assert packer is not None
        if layout == "varlen":
            groups = [b.positions for b in plan_packed_batches(lengths, token_budget, max_batch)]
        else:  # rows as wide as the model's limit, token_budget // width rows per batch
            groups = plan_rows(lengths, token_budget, encoder.max_length)
        for positions in groups:
            batch = packer.collate([tokens[p] for p in positions])
            vectors[[base + p for p in positions]] = packer.embed(batch)
            real += batch.real_tokens
            padded += batch.padded_tokens
    return Run(time.perf_counter() - started, len(texts), real, padded, vectors)


_PACKERS: dict[tuple[int, str], PackedEncoder | RowsEncoder] = {}


def _packer(encoder: Encoder, layout: str) -> PackedEncoder | RowsEncoder:
    """One packer per encoder and layout (varlen installs its attention once)."""
    key = (id(encoder), layout)
    if key not in _PACKERS:
        _PACKERS[key] = PackedEncoder(encoder) if layout == "varlen" else RowsEncoder(encoder)
    return _PACKERS[key]


class Fleet:
    """A real server for every fleet run; each run gets a fresh namespace and worker."""

    def __init__(self, url: str) -> None:
        self.url = url

    def run(
        self,
        encoder: Encoder,
        texts: list[str],
        ids: list[str],
        keep: bool,
        slice_ms: float = -1,
        settings: dict[str, object] | None = None,
        poll_s: float | None = None,
    ) -> Run:
        """One end-to-end run; ``settings`` overrides worker settings (the GPU check's budgets,
        loadtest.precisions' output dtype); ``poll_s`` reads the job's counters at that fixed
        interval instead of the producer's paced reads (producer/polling.py)."""
        return asyncio.run(self._run(encoder, texts, ids, keep, slice_ms, settings or {}, poll_s))

    async def _run(
        self,
        encoder: Encoder,
        texts: list[str],
        ids: list[str],
        keep: bool,
        slice_ms: float,
        overrides: dict[str, object],
        poll_s: float | None,
    ) -> Run:
        from embedfleet.producer.client import Producer
        from embedfleet.shared.protocol import Chunk
        from embedfleet.shared.redis_conn import connect
        from embedfleet.shared.settings import load_settings
        from embedfleet.sinks import RedisStreamSink
        from embedfleet.workers.worker import Worker

        namespace = f"bench{uuid.uuid4().hex[:8]}"
        settings = load_settings(
            redis_url=self.url,
            namespace=namespace,
            consumer="bench",
            log_level="warning",
            slice_ms=slice_ms,
            # every text through the model, as every other contender does: a corpus that
            # repeats a text must not be answered from the vector cache (issue 31)
            **({"vector_cache_mb": 0} | overrides),
        )
        worker_client = connect(self.url)
        worker = Worker(
            settings, encoder, worker_client, RedisStreamSink(worker_client, settings.keys)
        )
        # an int8/uint8 output's fleet-wide calibration exists before the clock starts (a
        # worker makes it once per model and dimension, not per run); other dtypes need none
        await worker.outputs.prepare([Chunk(id="c", text="c")], worker.on_model_thread)
        task = asyncio.create_task(worker.run())
        job = "bench"
        try:
            async with Producer(settings) as producer:
                await asyncio.sleep(0.2)  # the worker is up and blocked on XREADGROUP
                chunks = [{"id": i, "text": t} for i, t in zip(ids, texts, strict=True)]
                busy_before = worker.stats.model_seconds
                started = time.perf_counter()
                await producer.enqueue(chunks, job=job)
                # an interval of 10 ms or less is a fixed one (the pacer never waits less)
                pacing = {} if poll_s is None else {"interval": poll_s}
                progress = await producer.wait_for_job(job, timeout=3600, **pacing)
                seconds = time.perf_counter() - started
                busy = (worker.stats.model_seconds - busy_before) / seconds
                stats = worker.stats
                vectors = None
                if keep:
                    latest = {r.id: r.vector async for r in producer.results(job=job)}
                    vectors = np.stack([latest[i].astype(np.float32) for i in ids])
                worker.drain()
                await asyncio.wait_for(task, timeout=60)
                await producer.client.flushdb()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await worker_client.aclose()
        if progress.dead:
            raise RuntimeError(f"{progress.dead} chunks were dead-lettered during the benchmark")
        return Run(seconds, progress.done, stats.real_tokens, stats.padded_tokens, vectors, busy)


# --- serving-engine peers ------------------------------------------------------------------
def start_infinity_peers(
    wanted: bool,
    device: torch.device,
    auto_precision: str,
    texts: list[str],
    lengths: list[int],
    threads: int,
    say: Callable[[str], None],
) -> list[InfinityPeer]:
    """Infinity's torch engine in float32 and (where the fleet runs bf16) bfloat16, and its ONNX
    engine where the peer environment can export the model offline."""
    if not wanted:
        return []
    if not infinity_available():
        say("no Infinity contenders: `make bench-peers` builds .venv-infinity for them")
        return []
    configs = [InfinityConfig("torch", "float32")]
    if auto_precision == "bf16":
        configs.append(InfinityConfig("torch", "bfloat16"))
    configs.append(InfinityConfig("optimum", "float32"))
    model_dir = resolve_model_path("all-MiniLM-L6-v2")
    started: list[InfinityPeer] = []
    for config in configs:
        try:
            started.append(InfinityPeer(config, model_dir, texts, threads, str(device)))
        except RuntimeError as error:  # e.g. no ONNX export possible offline: say so, go on
            say(f"{config.label}: not run ({error})")
    return started


def peer_contender(peer: InfinityPeer, lengths: list[int]) -> Contender:
    """A peer's run, with padding counted as for a length-sorted batch of its batch size."""
    precision = "bf16" if peer.config.dtype == "bfloat16" else "fp32"

    def run(n: int) -> Run:
        seconds, vectors = peer.embed(n)
        padded = sorted_batch_padded_tokens(lengths[:n], peer.config.batch_size)
        return Run(seconds, n, sum(lengths[:n]), padded, vectors)

    return Contender(peer.config.label, precision, run)


def sorted_batch_padded_tokens(lengths: Sequence[int], batch_size: int) -> int:
    ordered = sorted(lengths, reverse=True)
    return sum(
        max(ordered[i : i + batch_size]) * len(ordered[i : i + batch_size])
        for i in range(0, len(ordered), batch_size)
    )


# --- the run -------------------------------------------------------------------------------
# the server of the fleet runs (here and in loadtest.precisions): --redis-url, else _server's own
redis_url_option = click.option(
    "--redis-url", default=None, help="Use this server instead of starting one."
)


@contextlib.contextmanager
def _server(redis_url: str | None) -> Iterator[str]:
    if redis_url:
        yield redis_url
        return
    from embedfleet.server import ServerProcess

    with ServerProcess() as server:
        yield server.url


def best_st_batch(
    model: object, texts: list[str], lengths: list[int]
) -> tuple[int, dict[int, float]]:
    """A short interleaved sweep (2 passes over a subset) for encode's best batch size."""
    rates: dict[int, list[float]] = {size: [] for size in ST_SWEEP}
    for _ in range(2):
        for size in ST_SWEEP:
            run = st_contender(model, texts, lengths, size)
            rates[size].append(run.texts / run.seconds)
    medians = {size: statistics.median(values) for size, values in rates.items()}
    return max(medians, key=medians.__getitem__), medians


def machine_line() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


@click.command()
@click.option("--texts", "count", type=int, default=1000, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=0, help="torch threads (0 = all cores).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--engines", is_flag=True, help="Add in-process layout/precision contenders.")
@click.option(
    "--compile",
    "use_compile",
    is_flag=True,
    help="Add torch.compile contenders (dynamic shapes; plain and with inductor freezing).",
)
@click.option("--only", default="", help="Comma-separated contender names to run (debugging).")
@redis_url_option
@click.option(
    "--peers/--no-peers",
    default=True,
    show_default=True,
    help="Add Infinity (infinity-emb) contenders from .venv-infinity (`make bench-peers`).",
)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw texts/s per contender, parity marked, to this PNG (needs matplotlib).",
)
def main(
    count: int,
    rounds: int,
    seed: int,
    threads: int,
    device: str,
    engines: bool,
    use_compile: bool,
    only: str,
    redis_url: str | None,
    peers: bool,
    json_out: Path | None,
    plot: Path | None,
) -> None:
    """Side-by-side throughput: sentence-transformers vs a naive loop vs the fleet."""
    import logging

    from sentence_transformers import SentenceTransformer

    from embedfleet.shared.logging import configure_logging
    from embedfleet.shared.settings import Settings

    configure_logging("warning", "console")
    logging.getLogger("sentence_transformers").setLevel(logging.WARNING)
    threads = threads or usable_cpus()
    torch.set_num_threads(threads)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731

    corpus = build_corpus(count, seed=seed)
    texts = [item.text for item in corpus]
    ids = [item.id for item in corpus]
    fp32 = Encoder(device=device, dtype="float32", threads=threads)
    auto = Encoder(device=device, dtype="auto", threads=threads)
    dev = fp32.device
    tokens: list[Tokenized] = fp32.tokenize(texts)
    lengths = [t.length for t in tokens]  # truncated to the model's limit
    raw = describe(token_lengths(texts), fp32.max_length)  # before truncation
    flops = useful_flops(lengths, fp32)
    defaults = Settings()
    say(f"machine: {machine_line()}")
    say(
        f"corpus: {count} texts, median {raw['median_tokens']:.0f} tokens, mean "
        f"{raw['mean_tokens']:.1f}, p99 {raw['p99_tokens']}, "
        f"{raw['over_max_fraction']:.1%} over {fp32.max_length} (truncated)"
    )
    say(auto.parity.line() if auto.parity else f"precision auto: {auto.precision.describe()}")
    auto_precision = "bf16" if auto.precision.dtype != torch.float32 else "fp32"
    # the worker's query/bulk graph, built now as a default worker would (EMBEDFLEET_CPU_INT8),
    # so that "fleet auto" is labelled with what it computes in and no round pays the compile
    auto.prepare_query_graph(int8=defaults.cpu_int8_choice)
    auto_label = "int8" if auto.computes_in_int8 else auto_precision

    st = SentenceTransformer(str(resolve_model_path(fp32.name)), device=str(dev))
    sweep_texts = texts[: min(len(texts), 400)]
    best, sweep = best_st_batch(st, sweep_texts, lengths[: len(sweep_texts)])
    say("encode batch sweep (texts/s): " + ", ".join(f"{k}: {v:.0f}" for k, v in sweep.items()))

    contenders = [
        Contender("st encode(32)", "fp32", lambda n: st_contender(st, texts[:n], lengths[:n], 32)),
    ]
    if best != 32:
        contenders.append(
            Contender(
                f"st encode({best})",
                "fp32",
                lambda n: st_contender(st, texts[:n], lengths[:n], best),
            )
        )
    contenders.append(
        Contender("naive padded(32)", "fp32", lambda n: naive_contender(fp32, texts[:n]))
    )
    batching = defaults.batching(dev.type)
    window, budget, max_batch = batching.read_count, batching.token_budget, batching.max_batch
    if engines:
        varlen32 = Encoder(device=device, dtype="float32", threads=threads)
        varlen_auto = Encoder(device=device, dtype="auto", threads=threads)
        for label, encoder, varlen_encoder, precision in (
            ("fp32", fp32, varlen32, "fp32"),
            ("auto", auto, varlen_auto, auto_precision),
        ):
            for layout in ("padded", "rows", "varlen"):
                chosen = varlen_encoder if layout == "varlen" else encoder
                contenders.append(
                    Contender(
                        f"engine {layout} {label}",
                        precision,
                        lambda n, e=chosen, la=layout: engine_contender(
                            e, texts[:n], la, window, budget, max_batch
                        ),
                    )
                )
        if auto.precision.method == "weights" and dev.type == "cpu":
            autocast = Encoder(device=device, dtype="float32", threads=threads)
            from embedfleet.workers.model.precision import Precision

            autocast.precision = Precision(torch.bfloat16, "autocast")
            contenders.append(
                Contender(
                    "engine padded bf16 autocast",
                    "bf16",
                    lambda n: engine_contender(
                        autocast, texts[:n], "padded", window, budget, max_batch
                    ),
                )
            )
    if engines and dev.type == "cpu":
        frozen_auto = Encoder(device=device, dtype="auto", threads=threads)
        if frozen_auto.prepare_query_graph():
            contenders.append(
                Contender(
                    "engine padded auto frozen",
                    auto_precision,
                    lambda n: engine_contender(
                        frozen_auto, texts[:n], "padded", window, budget, max_batch, frozen=True
                    ),
                )
            )
    if use_compile:
        compiled = Encoder(device=device, dtype="auto", threads=threads)
        compiled._model.forward = torch.compile(compiled._model.forward, dynamic=True)
        contenders.append(
            Contender(
                "engine padded auto compiled",
                auto_precision,
                lambda n: engine_contender(
                    compiled, texts[:n], "padded", window, budget, max_batch
                ),
            )
        )
        # inductor's freezing: weights folded in as constants and pre-packed for oneDNN, bias
        # and activations fused into the linear layers (the frozen TorchScript graph's
        # counterpart; its compile is a start-up cost, paid in the warm-up round)
        inductor_frozen = Encoder(device=device, dtype="auto", threads=threads)
        inductor_frozen._model.forward = torch.compile(
            inductor_frozen._model.forward, dynamic=True, options={"freezing": True}
        )
        contenders.append(
            Contender(
                "engine padded auto inductor frozen",
                auto_precision,
                lambda n: engine_contender(
                    inductor_frozen, texts[:n], "padded", window, budget, max_batch
                ),
            )
        )
    infinity = start_infinity_peers(peers, dev, auto_precision, texts, lengths, threads, say)
    contenders += [peer_contender(peer, lengths) for peer in infinity]
    if only:
        wanted = {name.strip() for name in only.split(",")}
        contenders = [c for c in contenders if c.name in wanted or c.name == "st encode(32)"]

    with _server(redis_url) as url:
        fleet = Fleet(url)

        def fleet_run(
            encoder: Encoder,
            n: int,
            slice_ms: float = -1,
            poll_s: float | None = None,
            settings: dict[str, object] | None = None,
        ) -> Run:
            # Vectors are read back (for parity) only on full runs; warm-ups use other ids.
            prefix = "" if n == len(texts) else "warm-"
            run_ids = [prefix + i for i in ids[:n]]
            return fleet.run(
                encoder, texts[:n], run_ids, not prefix, slice_ms, settings, poll_s=poll_s
            )

        if not only or "fleet fp32" in only:
            contenders.append(Contender("fleet fp32", "fp32", lambda n: fleet_run(fp32, n)))
        if "fleet fp32 unsliced" in only:  # what the priority lane's slicing costs bulk work
            contenders.append(
                Contender("fleet fp32 unsliced", "fp32", lambda n: fleet_run(fp32, n, 0))
            )
        if not only or "fleet auto" in only:
            contenders.append(Contender("fleet auto", auto_label, lambda n: fleet_run(auto, n)))
        if "fleet auto unsliced" in only:  # the same, bulk batches not sized to the slice
            contenders.append(
                Contender("fleet auto unsliced", auto_label, lambda n: fleet_run(auto, n, 0))
            )
        if "fleet auto eager bulk" in only and auto_precision != "fp32":
            # EMBEDFLEET_FROZEN_BULK=false: bulk batches eager in auto's precision (not through
            # an int8 copy), sliced per layer; queries still through the frozen or int8 copy
            contenders.append(
                Contender(
                    "fleet auto eager bulk",
                    auto_precision,
                    lambda n: fleet_run(auto, n, settings={"frozen_bulk": False}),
                )
            )
        if "fleet auto bf16" in only and auto_label == "int8":
            # EMBEDFLEET_CPU_INT8=false: the bf16 frozen copy, as before int8 was the default
            bf16_copy = Encoder(device=device, dtype="auto", threads=threads)
            bf16_copy.prepare_query_graph()
            contenders.append(
                Contender(
                    "fleet auto bf16",
                    auto_precision,
                    lambda n: fleet_run(bf16_copy, n, settings={"cpu_int8": False}),
                )
            )
        if "fleet auto 10ms polls" in only:  # what a producer polling beside the worker costs
            contenders.append(
                Contender(
                    "fleet auto 10ms polls",
                    auto_label,
                    lambda n: fleet_run(auto, n, poll_s=0.01),
                )
            )

        say(f"warming up {len(contenders)} contenders")
        for contender in contenders:
            contender.run(min(64, len(texts)))
        with_bf16 = auto_precision == "bf16"
        peak_before = measure_peak(dev, with_bf16)
        for number in range(rounds):
            order = contenders[number % len(contenders) :] + contenders[: number % len(contenders)]
            for contender in order:
                run = contender.run(len(texts))
                contender.runs.append(run)
                say(
                    f"round {number + 1}/{rounds} {contender.name}: "
                    f"{run.texts / run.seconds:.1f} texts/s ({run.seconds:.1f} s)"
                )
        peak_after = measure_peak(dev, with_bf16)
    for peer in infinity:
        peer.close()
    peak = Peak(max(peak_before.fp32, peak_after.fp32), max(peak_before.bf16, peak_after.bf16))

    baseline = contenders[0]
    reference = next(run.vectors for run in baseline.runs if run.vectors is not None)
    rows = []
    for contender in contenders:
        rates = [run.texts / run.seconds for run in contender.runs]
        ratios = [
            (run.texts / run.seconds) / (base.texts / base.seconds)
            for run, base in zip(contender.runs, baseline.runs, strict=True)
        ]
        first_run = contender.runs[0]
        median_seconds = statistics.median(run.seconds for run in contender.runs)
        parity = next(
            (cosines(reference, run.vectors) for run in contender.runs if run.vectors is not None),
            None,
        )
        busy = [run.model_busy for run in contender.runs if run.model_busy is not None]
        rows.append(
            {
                "name": contender.name,
                "precision": contender.precision,
                "texts_per_s": statistics.median(rates),
                "tokens_per_s": first_run.real_tokens / median_seconds,
                "padding_waste": 1 - first_run.real_tokens / first_run.padded_tokens,
                "ratio": statistics.median(ratios),
                "mfu": flops / median_seconds / peak.of(contender.precision),
                "model_busy": statistics.median(busy) if busy else None,
                "min_cosine_vs_st": None if parity is None else float(parity.min()),
                "mean_cosine_vs_st": None if parity is None else float(parity.mean()),
                "rates": rates,
            }
        )
    table = render_table(rows)
    print(f"machine: {machine_line()}")
    print(
        f"corpus: {count} texts (seed {seed}), median {raw['median_tokens']:.0f} tokens, "
        f"{raw['over_max_fraction']:.1%} truncated; {rounds} rounds interleaved; "
        f"worker defaults: read_count {window}, token_budget {budget}, max_batch {max_batch}"
    )
    print(
        f"matmul peak (this run): fp32 {peak.fp32 / 1e9:.0f} GFLOP/s, bf16 "
        f"{peak.bf16 / 1e9:.0f} GFLOP/s; model {flops / sum(lengths) / 1e6:.1f} MFLOP per real "
        f"token on this corpus"
    )
    print(auto.parity.line() if auto.parity else f"precision auto: {auto.precision.describe()}")
    print(
        f"st encode batch sweep (texts/s): {', '.join(f'{k}: {v:.0f}' for k, v in sweep.items())}"
    )
    print(table)
    if plot is not None:
        from loadtest.plots import plot_throughput

        subtitle = (
            f"{machine_line()}\n{count} texts (seed {seed}), {rounds} rounds interleaved; "
            f"min cos vs st: the worst text's cosine to sentence-transformers' vector"
        )
        print(f"chart: {plot_throughput(rows, plot, subtitle)}")
    if json_out is not None:
        json_out.write_text(
            json.dumps(
                {
                    "machine": machine_line(),
                    "corpus": raw,
                    "peak": {"fp32": peak.fp32, "bf16": peak.bf16},
                    "rows": rows,
                },
                indent=2,
            )
        )


def render_table(rows: list[dict]) -> str:
    lines = [
        "| contender | texts/s | real tokens/s | padding waste | × encode(32) | MFU | model busy "
        "| min cos vs st | mean cos vs st |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        busy = "" if row["model_busy"] is None else f"{row['model_busy']:.0%}"
        parity = "" if row["min_cosine_vs_st"] is None else f"{row['min_cosine_vs_st']:.5f}"
        mean = "" if row["mean_cosine_vs_st"] is None else f"{row['mean_cosine_vs_st']:.6f}"
        lines.append(
            f"| {row['name']} ({row['precision']}) | {row['texts_per_s']:.1f} | "
            f"{row['tokens_per_s']:,.0f} | {row['padding_waste']:.1%} | {row['ratio']:.2f} | "
            f"{row['mfu']:.1%} | {busy} | {parity} | {mean} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
