"""The test zoo's models are the same in every test process: its tokenizers, trained at each
run, number their tokens alike in any process (tests/model_zoo.py ``_ids_in_one_order``). They
did not: the trainers numbered tokens in a hash map's order, seeded per process, so a parity
test near a tie failed at random in one run of CI and passed in the next."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.model_zoo import _fast_tokenizer
from tests.paths import REPO_ROOT

# one family per trainer the zoo uses: WordPiece, Unigram, byte-level BPE
TRAINED = ("bert", "xlm-roberta", "qwen2")


def test_each_trained_tokenizer_is_the_same_in_another_process() -> None:
    here = [_fast_tokenizer(family).backend_tokenizer.to_str() for family in TRAINED]
    code = (
        "import json\n"
        "from tests.model_zoo import _fast_tokenizer\n"
        f"print(json.dumps([_fast_tokenizer(f).backend_tokenizer.to_str() for f in {TRAINED!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    there = json.loads(done.stdout.strip().splitlines()[-1])
    for family, ours, theirs in zip(TRAINED, here, there, strict=True):
        assert ours == theirs, f"{family}: the trained tokenizer differs between processes"
