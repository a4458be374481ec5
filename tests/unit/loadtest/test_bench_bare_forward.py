"""loadtest/bench.py's bare forward (issue 53: the fleet end to end ÷ its engine alone): the
default worker's encoder over the worker's planned batches, vectors in input order equal to the
encoder's own, every real token counted, and only the forward passes on the clock."""

from __future__ import annotations

import time

import numpy as np

from embedfleet.shared.settings import Settings
from loadtest.bench import bare_forward_contender
from loadtest.corpus import build_corpus


def test_bare_forward_gives_the_encoders_vectors_in_input_order(encoder) -> None:
    texts = [item.text for item in build_corpus(48, seed=3)]
    started = time.perf_counter()
    run = bare_forward_contender(encoder, Settings(), texts, 16, 2048, 8)
    whole = time.perf_counter() - started
    assert run.texts == len(texts)
    assert run.real_tokens == sum(t.length for t in encoder.tokenize(texts))
    assert run.padded_tokens >= run.real_tokens
    assert run.vectors is not None
    expected = np.concatenate([encoder.embed_texts([text]) for text in texts])
    cosines = np.sum(run.vectors * expected, axis=1)  # both normalised by the model
    assert cosines.min() > 0.999
    # tokenizing and collating happen before the clock
    assert 0 < run.seconds < whole
