"""workers/model/heldout.py: the held-out parity set is what its docstring promises, three
groups where reduced precision fails first, each text once, none a calibration or probe text,
its long passages near and over the packaged model's 256 tokens."""

from __future__ import annotations

from transformers import AutoTokenizer

from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.calibration import calibration_texts
from embedfleet.workers.model.heldout import GROUPS, HELDOUT_TEXTS, LONG, ODD
from embedfleet.workers.model.precision import PROBE_TEXTS


def test_the_set_is_its_three_groups_each_text_once() -> None:
    assert list(GROUPS) == ["multilingual", "long", "odd"]
    assert tuple(text for group in GROUPS.values() for text in group) == HELDOUT_TEXTS
    assert len(set(HELDOUT_TEXTS)) == len(HELDOUT_TEXTS)
    assert all(len(group) >= 5 for group in GROUPS.values())


def test_no_text_is_one_a_path_was_tuned_on() -> None:
    tuned = set(PROBE_TEXTS) | set(calibration_texts())
    assert not tuned & set(HELDOUT_TEXTS)


def test_the_long_passages_are_near_and_over_the_models_limit() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(PACKAGED_MODEL))
    lengths = [len(ids) for ids in tokenizer(list(LONG))["input_ids"]]
    assert min(lengths) > 150 and max(lengths) > 256


def test_the_odd_inputs_hold_what_prose_lacks() -> None:
    assert min(len(text) for text in ODD) == 1, "a lone character"
    assert any(text != text.strip() for text in ODD), "whitespace at the ends"
    assert any(not text.isascii() and "\u200b" in text for text in ODD), "zero-width spaces"
