"""workers/model/tokenizer.py with the packaged model's tokenizer: ids framed by the special
tokens, a cut seen and [SEP] kept, a prompt's length, a producer's ids fitted alike, the padded
batch; a long input's windows (split_windows)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.shared.tokens import pack_token_ids, token_id_array
from embedfleet.workers.model.model_dir import read_model_spec
from embedfleet.workers.model.tokenizer import (
    TextTokenizer,
    Tokenized,
    split_windows,
    tokenized,
)

CLS, SEP = 101, 102
PACKAGED = resolve_model_path(PACKAGED_MODEL)


@pytest.fixture(scope="module")
def text() -> TextTokenizer:
    return TextTokenizer(AutoTokenizer.from_pretrained(PACKAGED), read_model_spec(PACKAGED), 16)


def test_a_text_is_framed_by_the_special_tokens(text: TextTokenizer) -> None:
    (short,) = text.tokenize(["Hello world"], None)
    assert short.ids[0] == CLS and short.ids[-1] == SEP and short.length == 4
    assert not short.truncated and short.prompt_length == 0


def test_a_text_over_the_maximum_is_cut_keeping_its_last_special_token(
    text: TextTokenizer,
) -> None:
    (cut,) = text.tokenize([" ".join(["word"] * 40)], None)
    assert cut.truncated and cut.length == 16
    assert cut.ids[0] == CLS and cut.ids[-1] == SEP
    (exact,) = text.tokenize([" ".join(["word"] * 14)], None)
    assert not exact.truncated and exact.length == 16, "at the maximum: not cut"


def test_a_prompt_counts_its_tokens_and_a_producers_ids_fit_alike(text: TextTokenizer) -> None:
    (prompted,) = text.tokenize(["a cat"], ["query: "])
    assert prompted.prompt_length == text.prompt_length("query: ") == 3  # [CLS] query :
    long_ids = [CLS, *([2773] * 30), SEP]
    fitted = text.from_ids(long_ids, "")
    assert fitted.truncated and list(fitted.ids) == [CLS, *([2773] * 14), SEP]


def test_a_batch_is_padded_on_the_right_with_its_mask(text: TextTokenizer) -> None:
    batch = text.collate([Tokenized([CLS, 7, 8, SEP], False), Tokenized([CLS, SEP], False)])
    assert batch.input_ids.tolist() == [[CLS, 7, 8, SEP], [CLS, SEP, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert (batch.size, batch.padded_tokens, batch.real_tokens) == (2, 8, 6)
    assert batch.prompt_lengths is None and batch.token_type_ids is None
    assert batch.input_ids.dtype == torch.int64


def test_a_batch_lays_each_row_as_its_ids_on_either_side_from_lists_or_producer_arrays(
    text: TextTokenizer,
) -> None:
    """The collation lays every row at once (issue 53): the same buffers as row by row, on the
    left as on the right, with a producer's packed ids, a tokenized list, or both."""
    rows = [[CLS, 7, 8, SEP], [CLS, SEP], [CLS, 9, SEP]]
    packed = [token_id_array(pack_token_ids(ids)) for ids in rows]
    mixed = [packed[0], rows[1], packed[2]]
    for pad_left in (False, True):
        for items in (rows, packed, mixed):
            left = TextTokenizer.__new__(TextTokenizer)
            left.__dict__.update(text.__dict__, pad_left=pad_left)
            batch = left.collate([Tokenized(ids, False) for ids in items])
            width = 4
            expected_ids, expected_mask = [], []
            for ids in rows:
                pad = [0] * (width - len(ids))
                expected_ids.append(pad + ids if pad_left else ids + pad)
                ones = [1] * len(ids)
                expected_mask.append([0] * len(pad) + ones if pad_left else ones + [0] * len(pad))
            assert batch.input_ids.tolist() == expected_ids
            assert batch.attention_mask.tolist() == expected_mask
            assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.int64


def test_tokens_made_without_init_equal_those_made_with_it() -> None:
    made = tokenized([CLS, 7, SEP], True, 2, 3)
    assert made == Tokenized([CLS, 7, SEP], True, prompt_length=2)
    assert made.length == 3 and made.type_ids is None


def test_windows_keep_the_frame_and_overlap() -> None:
    ids = [CLS, *range(1, 11), SEP]  # ten ids of text
    windows = split_windows(ids, max_length=6, lead=1, trail=1, overlap=1)
    assert windows == [
        [CLS, 1, 2, 3, 4, SEP],
        [CLS, 4, 5, 6, 7, SEP],
        [CLS, 7, 8, 9, 10, SEP],
    ]
    assert split_windows(ids, max_length=12, lead=1, trail=1, overlap=3) == [ids], "it fits"


def test_an_overlap_that_leaves_no_room_to_advance_is_refused() -> None:
    with pytest.raises(ValueError, match=r"window_overlap=4 leaves no room.*use 0\.\.3"):
        split_windows(list(range(20)), max_length=6, lead=1, trail=1, overlap=4)
