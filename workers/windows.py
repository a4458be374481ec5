"""Windows: what a worker reads in one go, opened (decoded, prompted, looked up in the vector
cache, tokenized) and planned into batches before the compute stage runs them.

``WindowOpener.open_window`` makes one read a window: on the tokenizer thread decoded, validated
and given prompts and content keys, those past their deadline set aside (workers/deadlines.py);
looked up in the vector cache on the event loop (workers/cache_lookup.py: a hit's result is made
from the stored vector and skips the model); on the tokenizer thread again tokenized (the batch
call on the encoding thread, one window's at a time, while the other tokenizer thread runs the
Python of the window read before or after it: workers/intake.py), long
inputs split into token windows (workers/long_inputs.py), texts over the model's maximum set
aside (workers/overlong.py), sorted by length, planned into batches by token budget and
collated into host buffers. The reader that calls it: workers/intake.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.vector_cache import CachedVector
from embedfleet.sinks import Delivery
from embedfleet.workers.batcher import PlannedBatch
from embedfleet.workers.bulk import BulkBatch
from embedfleet.workers.cache_lookup import answered, look_up
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.deadlines import split_expired
from embedfleet.workers.decode import Accepted, decode_entries
from embedfleet.workers.image_sources import ImageSources
from embedfleet.workers.images import ImagePipeline, ImageRows, take_images
from embedfleet.workers.long_inputs import (
    Rejoin,
    before_normalize_wanted,
    expand,
    token_windows,
)
from embedfleet.workers.model.encoder import Tokenized
from embedfleet.workers.overlong import set_aside_overlong
from embedfleet.workers.parts import StageParts
from embedfleet.workers.token_ids import tokenize_chunks


@dataclass
class Prepared:
    """One planned batch of a window, collated into host buffers."""

    planned: PlannedBatch
    batch: BulkBatch


@dataclass
class Window:
    """Valid chunks read together, tokenized, with the entries they came from, and their
    batches ready to launch."""

    chunks: list[Chunk]
    deliveries: list[Delivery]
    tokens: list[Tokenized]
    batches: list[Prepared] = field(default_factory=list)
    # entries read with the window whose caller's deadline had passed: acknowledged unembedded
    expired: list[Delivery] = field(default_factory=list)
    # chunks the vector cache answered (not in ``chunks``: they skip the model), with their
    # entries and the results made from the stored vectors
    cached: list[tuple[Chunk, Delivery, Result]] = field(default_factory=list)
    # the content key of each chunk to embed that the cache may store (by its entry)
    content_keys: dict[Delivery, str] = field(default_factory=dict)
    # long inputs embedded whole (``window_overlap``): ``chunks``, ``deliveries`` and
    # ``tokens`` hold one row per token window, which this rejoins after the model
    # (workers/long_inputs.py); None: one row per chunk
    rejoin: Rejoin | None = None
    # a dual encoder's image chunks, preprocessed (workers/images.py); None: none
    images: ImageRows | None = None

    def kept(self, keep: list[int]) -> Window:
        """The window with only the rows at ``keep`` (chunks, entries, tokens)."""
        return dataclasses.replace(
            self,
            chunks=[self.chunks[i] for i in keep],
            deliveries=[self.deliveries[i] for i in keep],
            tokens=[self.tokens[i] for i in keep],
        )

    @property
    def empty(self) -> bool:
        """Nothing to embed or answer: no chunk, no cached result, no image (a window of
        images alone is not empty: issue 56)."""
        return not self.chunks and not self.cached and self.images is None

    @property
    def held(self) -> list[Delivery]:
        """Every entry the window answers: those to embed and those the cache answered."""
        pictures = self.images.deliveries if self.images is not None else []
        return [*self.deliveries, *(delivery for _, delivery, _ in self.cached), *pictures]


class WindowOpener:
    """Opens reads as windows for the intake stage (and the interactive stream's jump)."""

    def __init__(self, parts: StageParts, prepare: Callable[[Window], list[Prepared]]) -> None:
        self.parts = parts
        # the compute stage's planning and collation of a window's batches (tokenizer thread)
        self._prepare = prepare
        # a dual encoder's lane (CLIP, SigLIP): its images' decoding and preprocessing
        settings = parts.settings
        self._images = ImagePipeline.for_encoder(
            parts.encoder, settings.max_image_bytes, ImageSources.of(settings)
        )
        # whether the latest window opened had texts to tokenize here: the tokenizer's Rust
        # that a window opened beside it runs its Python against (workers/intake.py); windows
        # of producers' ids are all Python, which two threads would only take turns on
        self.tokenizes = True

    async def open_window(self, entries: list[StreamEntry]) -> tuple[Window, list[Rejected]]:
        """Entries → a window, and what to dead-letter: decoded, validated and given their
        prompts and content keys on the tokenizer thread (``_decode_window``), looked up in the
        vector cache here (workers/cache_lookup.py: the hits skip the model), the rest
        tokenized, planned and collated on the tokenizer thread again (``_tokenize_window``)."""
        loop = asyncio.get_running_loop()
        accepted, prompts, keys, expired, rejected = await loop.run_in_executor(
            self.parts.threads.tokenizer, self._decode_window, entries
        )
        parts = self.parts
        hits = await look_up(
            parts.vector_cache,
            parts.keys,
            parts.events,
            accepted,
            keys,
            truncate=parts.settings.truncate,
        )
        window = await loop.run_in_executor(
            self.parts.threads.tokenizer,
            functools.partial(
                self._tokenize_window, accepted, prompts, keys, hits, expired, rejected
            ),
        )
        return window, rejected

    def _decode_window(
        self, entries: list[StreamEntry]
    ) -> tuple[list[Accepted], list[str], list[str | None], list[Delivery], list[Rejected]]:
        """On the tokenizer thread: entries decoded and validated, those past their deadline
        set aside, prompts chosen (chunks whose options the model cannot honour rejected) and
        each chunk's content key made (None: not cached, or the cache is off)."""
        accepted, rejected = decode_entries(entries, self.parts.settings)
        # a caller past its deadline (a timed-out interactive request) has gone: not embedded
        accepted, expired = split_expired(accepted, time.time() * 1000)
        accepted, prompts = self._with_prompts(accepted, rejected)
        keys: list[str | None] = [None] * len(accepted)
        if self.parts.vector_cache.enabled:
            keys = [
                self.parts.outputs.content_key(a.chunk, p)
                for a, p in zip(accepted, prompts, strict=True)
            ]
        return accepted, prompts, keys, expired, rejected

    def _tokenize_window(
        self,
        accepted: list[Accepted],
        prompts: list[str],
        keys: list[str | None],
        hits: dict[int, CachedVector],
        expired: list[Delivery],
        rejected: list[Rejected],
    ) -> Window:
        """On the tokenizer thread: the cache's hits made into results, the other chunks
        tokenized, those over the model's maximum set aside (EMBEDFLEET_TRUNCATE=false), the
        rest planned into batches and collated."""
        cached = answered(accepted, hits)
        rest = [p for p in range(len(accepted)) if p not in hits]
        images = None
        if self._images is not None:  # a dual encoder's lane: its images, once a window
            rest, images = take_images(self._images, accepted, rest, keys, rejected)
        if not rest:
            return Window([], [], [], expired=expired, cached=cached, images=images)
        chunks = [accepted[p].chunk for p in rest]
        tokenized = tokenize_chunks(
            chunks, [prompts[p] for p in rest], self.parts.encoder, self.parts.threads.encode
        )
        self.tokenizes = tokenized.tokenized_here > 0
        if tokenized.refused:
            rejected += [
                Rejected.chunk(accepted[rest[i]].delivery, chunks[i], DeadReason.TOKENIZER, reason)
                for i, reason in tokenized.refused
            ]
            chunks = [chunks[i] for i in tokenized.kept]
            rest = [rest[i] for i in tokenized.kept]
        texts_prompts = [prompts[p] for p in rest]
        deliveries = [accepted[p].delivery for p in rest]
        window = Window(
            chunks,
            deliveries,
            tokenized.tokens,
            expired=expired,
            cached=cached,
            content_keys={
                delivery: key
                for delivery, p in zip(deliveries, rest, strict=True)
                if (key := keys[p]) is not None
            }
            if any(key is not None for key in keys)
            else {},
            images=images,
        )
        window = self._in_windows(window, texts_prompts, rejected)
        if not self.parts.settings.truncate and any(t.truncated for t in window.tokens):
            # EMBEDFLEET_TRUNCATE=false: texts over the model's maximum are dead-lettered
            keep, too_long = set_aside_overlong(
                window.chunks, window.deliveries, window.tokens, self.parts.encoder.max_length
            )
            rejected += too_long
            window = window.kept(keep)
        if window.chunks:
            window.batches = self._prepare(window)
        return window

    def _with_prompts(
        self, accepted: list[Accepted], rejected: list[Rejected]
    ) -> tuple[list[Accepted], list[str]]:
        """Each chunk's prompt (the document lane's unless it names one); chunks whose options
        the model cannot honour go to ``rejected`` with the reason."""
        kept: list[Accepted] = []
        prompts: list[str] = []
        prompt_for = self.parts.outputs.prompt_for
        plain: str | None = None  # a plain chunk's prompt, the same for every one (issue 53)
        for item in accepted:
            if plain is not None and item.chunk.plain:
                prompts.append(plain)
                kept.append(item)
                continue
            try:
                prompt = prompt_for(item.chunk, "document")
            except ValueError as error:
                delivery, chunk = item.delivery, item.chunk
                rejected.append(Rejected.chunk(delivery, chunk, DeadReason.OPTIONS, str(error)))
                continue
            if item.chunk.plain:
                plain = prompt
            prompts.append(prompt)
            kept.append(item)
        return kept, prompts

    def _in_windows(self, window: Window, prompts: list[str], rejected: list[Rejected]) -> Window:
        """Long inputs embedded whole (issue 42): each chunk with ``window_overlap`` whose text
        was cut becomes one row per token window (workers/long_inputs.py); one whose overlap
        leaves a window no room goes to ``rejected``."""
        model_normalizes = self.parts.encoder.pooling.normalize
        windows, refused = token_windows(
            self.parts.encoder.text.windows,
            window.chunks,
            window.deliveries,
            window.tokens,
            prompts,
        )
        if not windows and not refused:
            if before_normalize_wanted(window.chunks, model_normalizes):
                # a chunk wants its vector before Normalize: the window's batches come back
                # before it and the rejoin normalises the other rows (workers/long_inputs.py)
                return dataclasses.replace(window, rejoin=Rejoin(normalize=model_normalizes))
            return window
        rejected += refused.values()
        keep = [i for i in range(len(window.chunks)) if i not in refused]
        kept_at = {i: at for at, i in enumerate(keep)}
        rejoin = Rejoin(normalize=model_normalizes)
        chunks, deliveries, tokens = expand(
            [window.chunks[i] for i in keep],
            [window.deliveries[i] for i in keep],
            [window.tokens[i] for i in keep],
            {kept_at[i]: rows for i, rows in windows.items()},
            rejoin,
        )
        return dataclasses.replace(
            window, chunks=chunks, deliveries=deliveries, tokens=tokens, rejoin=rejoin
        )
