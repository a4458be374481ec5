"""A request's answers (producer/replies.py): one per input, in any order, an input answered
twice kept once, a refusal kept by position."""

from __future__ import annotations

import numpy as np
import pytest

from embedfleet.producer.replies import Answers, answer_index
from embedfleet.shared.protocol import Result, encode_query_error, encode_result


def _payload(chunk_id: str, values: list[float]) -> bytes:
    vector = np.array(values, dtype=np.float16)
    return encode_result(Result(id=chunk_id, model="m", vector=vector))


def test_the_index_is_the_ids_last_part() -> None:
    assert answer_index("req-1:12") == 12
    assert answer_index("3") == 3
    assert answer_index(b"a:b:7".decode()) == 7


def test_answers_fill_their_rows_in_input_order() -> None:
    answers = Answers(3)
    assert answers.take(_payload("r:2", [0.5, 1.0])) is None
    assert answers.take(_payload("r:0", [1.0, 0.0])) is None
    assert (answers.complete, answers.missing, answers.unanswered()) == (False, 1, [1])
    with pytest.raises(ValueError, match="1 of 3 inputs have no answer yet"):
        answers.array()
    answers.take(_payload("r:1", [0.25, 0.75]))
    answers.take(_payload("r:1", [0.25, 0.75]))  # answered twice: kept once
    array = answers.array()
    assert array.dtype == np.float32  # the wire's fp16 widened
    assert array.tolist() == [[1.0, 0.0], [0.25, 0.75], [0.5, 1.0]]


def test_a_refusal_is_kept_by_position_and_has_no_vector() -> None:
    answers = Answers(2)
    failure = answers.take(encode_query_error("r:1", "too long"))
    assert failure is not None and failure.reason == "too long"
    answers.take(_payload("r:0", [1.0]))
    assert answers.complete and list(answers.failures) == [1]
    assert answers.succeeded.tolist() == [True, False]
