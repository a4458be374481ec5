"""workers/model/tokenizer.py with the packaged model's tokenizer: ids framed by the special
tokens, a cut seen and [SEP] kept, a prompt's length, a producer's ids fitted alike, the padded
batch; a long input's windows (split_windows)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.model.model_dir import read_model_spec
from embedfleet.workers.model.tokenizer import TextTokenizer, Tokenized, split_windows

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
