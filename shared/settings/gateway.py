"""Gateway settings: `embedfleet serve`, the HTTP door (OpenAI and TEI dialects)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from embedfleet.shared.settings.section import Section

# the one environment variable the gateway reads without the EMBEDFLEET_ prefix: TEI's name for
# its key (`text-embeddings-router --api-key`, env API_KEY), so a TEI deployment's Secret keeps
# protecting the gateway that replaces it
TEI_API_KEY_VARIABLE = "API_KEY"


def parse_model_aliases(text: str) -> dict[str, str]:
    """EMBEDFLEET_GATEWAY_MODEL_ALIASES (``name=model,name=model``) as a mapping; ValueError for a
    pair without its ``=`` or a name given twice (load_settings names the variable)."""
    aliases: dict[str, str] = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        name, equals, model = (piece.strip() for piece in pair.partition("="))
        if not equals or not name or not model:
            raise ValueError(
                f"{pair!r} is not NAME=MODEL (e.g. text-embedding-ada-002=all-MiniLM-L6-v2)"
            )
        if name in aliases:
            raise ValueError(f"the name {name!r} is given twice")
        aliases[name] = model
    return aliases


class GatewaySettings(Section):
    """Where the gateway listens, who it lets in, the limits of a request and how long it waits."""

    title: ClassVar[str] = "HTTP gateway (`embedfleet serve`)"

    gateway_host: str = "127.0.0.1"
    """Address `embedfleet serve` binds."""
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    """Port of `embedfleet serve`."""
    gateway_grpc_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of TEI's gRPC API (tei.v1: Info, Embed, Predict, Rerank, Tokenize), served by the same
    process beside HTTP, on EMBEDFLEET_GATEWAY_HOST (docs/GATEWAY.md#grpc). Unset: no gRPC
    server."""
    served_model_name: str | None = None
    """Model name the gateway answers to (`model` in requests, /v1/models). Unset: the worker's
    model name."""
    api_keys: str | None = None
    """Comma-separated API keys the gateway accepts as `Authorization: Bearer`. Unset together with
    EMBEDFLEET_API_KEYS_FILE: no authentication."""
    api_keys_file: str | None = None
    """File of API keys, one per line (a mounted Secret); read at start."""
    tei_api_key: str | None = Field(default=None, validation_alias=TEI_API_KEY_VARIABLE)
    """TEI's variable, read as TEI reads it (no `EMBEDFLEET_` prefix): one more key the gateway
    accepts as `Authorization: Bearer`, beside EMBEDFLEET_API_KEYS and EMBEDFLEET_API_KEYS_FILE,
    so a TEI deployment's key keeps the gateway that replaces it closed."""
    gateway_max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest JSON request body the gateway reads (413 beyond it)."""
    gateway_max_inputs: int = Field(default=2048, ge=1)
    """Most inputs in one embeddings request (OpenAI's limit)."""
    gateway_max_request_tokens: int = Field(default=300_000, ge=1)
    """Most tokens in one /v1/embeddings request, all its inputs together, in the model's tokens
    as `usage` counts them (OpenAI's limit, and its 400 `max_tokens_per_request` beyond it); a
    Batch API line over it is answered in the error file."""
    gateway_max_input_chars: int = Field(default=100_000, ge=1)
    """Longest text input in characters. A request that truncates (below) has a longer text cut
    to this many characters first, then to the model's maximum in tokens, as TEI cuts
    characters before tokens; one that does not is refused (400 on /v1, 422 on TEI's routes)."""
    gateway_auto_truncate: bool = True
    """TEI's routes (/embed, /embed_sparse, /embed_all, /rerank, /predict, ...): a text over the
    model's maximum is cut to fit when the request leaves `truncate` out, as TEI's router does
    with its `--auto-truncate` (on by default); GET /info reports it as `auto_truncate`. A
    request's `"truncate": false` still refuses the text (422). Off: refused unless the request
    sends `"truncate": true`."""
    gateway_openai_truncate: bool = False
    """/v1/embeddings: cut an input over the model's maximum to fit when the request leaves
    `truncate` (this gateway's extension) out. Off: OpenAI's answer, 400
    `context_length_exceeded`, unless the request sends `"truncate": true`."""
    gateway_lane_max_inputs: int = Field(default=16, ge=1)
    """Requests with at most this many inputs ride the query stream; larger ones go to the
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
    gateway_cors_allow_origins: str | None = None
    """Origins a browser may call the gateway from (CORS), comma-separated, e.g.
    `https://app.example.com,http://localhost:3000`. Unset: any origin, as TEI's
    `--cors-allow-origin` defaults; empty: CORS off (no `Access-Control-*` headers, a preflight
    `OPTIONS` is refused). Methods GET and POST, headers `Content-Type` and `Authorization`; TEI's
    timing headers are exposed to the page."""
    gateway_accept_token_ids: bool = False
    """Accept token ids as `input` on /v1/embeddings (and in batch lines), decoded with the served
    model's own tokenizer. Off: token ids get a 400, because ids from another tokenizer (LangChain's
    `OpenAIEmbeddings` sends tiktoken ids unless `check_embedding_ctx_length=False`) would embed
    the wrong text without an error."""
    gateway_tiktoken_encoding: str | None = None
    """Read token ids in `input` on /v1/embeddings (and in batch lines) as ids of this tiktoken
    encoding, decode them to text and embed the text: what LangChain's `OpenAIEmbeddings` sends
    with its defaults is `cl100k_base`'s ids. A name (`cl100k_base`, `o200k_base`) is read from
    tiktoken's cache (`TIKTOKEN_CACHE_DIR`) and never downloaded (the gateway sends nothing
    anywhere), or the path of a `.tiktoken` file (one base64 token and its rank a line); read at
    start. Needs the `tiktoken` package (the gateway extra has it). Unset: token ids get a 400
    naming this setting. Not with EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS (the ids are one
    tokenizer's or the other's)."""
    gateway_model_aliases: str = ""
    """Other names a request's `model` may use, comma-separated `NAME=MODEL` pairs, e.g.
    `text-embedding-ada-002=all-MiniLM-L6-v2`: a request naming NAME goes to MODEL (the gateway's
    own model or a registered lane), as a TEI deployment ignores the field. A name neither served
    nor aliased is still 404 `model_not_found`, as OpenAI answers."""

    @field_validator("gateway_model_aliases")
    @classmethod
    def _aliases(cls, value: str) -> str:
        parse_model_aliases(value)
        return value

    @property
    def model_aliases(self) -> dict[str, str]:
        """EMBEDFLEET_GATEWAY_MODEL_ALIASES parsed (checked at load)."""
        return parse_model_aliases(self.gateway_model_aliases)

    @model_validator(mode="after")
    def _one_kind_of_token_ids(self) -> GatewaySettings:
        if self.gateway_accept_token_ids and self.gateway_tiktoken_encoding:
            raise ValueError(
                "EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS and EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING are "
                "both set: token ids are read as the served model's or as the tiktoken "
                "encoding's, not both. Unset one of them"
            )
        return self
