"""Every model family, pooling mode and option, embedded as sentence-transformers embeds it.

Tiny random-weight models (tests/model_zoo.py) saved as sentence-transformers directories; the
worker's path (tokenize, length-sorted batches padded on the tokenizer's side, forward, pooling,
Dense, Normalize) against ``SentenceTransformer.encode`` of the same directory: min cosine
>= 0.9999 in float32, one test row per family x pooling x option (`-k` selects rows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.model_dir import UnsupportedModelError
from embedfleet.workers.model.precision import cosines
from tests import model_zoo
from tests.model_zoo import FAMILIES, corpus_lines, sentence_transformers_dir

MIN_COSINE = 0.9999
DECODERS = ("qwen2", "qwen3")
POOLING_MODES = ("mean", "cls", "max", "weightedmean", "lasttoken", "mean_sqrt_len_tokens")
QUERY_PROMPTS = {"query": "Represent this question for retrieval: ", "passage": "passage: "}


def texts() -> list[str]:
    """Short, medium and over-long texts (the models take 48 tokens), so batches pad and cut."""
    lines = corpus_lines()
    picked = [lines[i] for i in range(0, 4000, 333)][:10]
    return [
        "hi",
        "What does the garbage collector do?",
        *picked,
        " ".join(lines[100:140]),  # far over the limit: truncated on both sides alike
    ]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def fleet_vectors(encoder: Encoder, inputs: list[str], prompt: str = "") -> np.ndarray:
    """The worker's path: tokenize a window, cut it into length-sorted batches, embed each."""
    tokens = encoder.tokenize(inputs, [prompt] * len(inputs) if prompt else None)
    vectors = np.zeros((len(inputs), encoder.dim), dtype=np.float32)
    for planned in plan_batches([t.length for t in tokens], token_budget=256, max_batch=5):
        batch = encoder.collate([tokens[p] for p in planned.positions])
        vectors[planned.positions] = encoder.embed(batch)
    return vectors


def reference(model_dir: Path, inputs: list[str], **encode_options: object) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(inputs, batch_size=4, convert_to_numpy=True, **encode_options)


def assert_parity(ours: np.ndarray, theirs: np.ndarray, label: str) -> float:
    assert ours.shape == theirs.shape, label
    worst = float(cosines(ours, theirs).min())
    print(f"PARITY {label}: min cosine {worst:.9f}")  # the matrix, read off `pytest -s`
    assert worst >= MIN_COSINE, f"{label}: min cosine {worst}"
    return worst


# --- the matrix -------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", POOLING_MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pooling_mode(zoo: Path, family: str, pooling: str) -> None:
    model_dir = sentence_transformers_dir(family, zoo, pooling=pooling)
    ours = fleet_vectors(Encoder(str(model_dir), device="cpu"), texts())
    assert_parity(ours, reference(model_dir, texts()), f"{family} {pooling} normalize")


OPTIONS = {
    # name: (sentence_transformers_dir options, prompt used on both sides)
    "dense+normalize": (dict(dense=24), ""),
    "no-normalize": (dict(normalize=False), ""),
    "concat mean+max+cls": (dict(pooling=("mean", "max", "cls"), name="concat"), ""),
    "include_prompt=false": (
        dict(include_prompt=False, prompts=QUERY_PROMPTS, name="noprompt"),
        "Represent this question for retrieval: ",
    ),
    "prompt": (dict(prompts=QUERY_PROMPTS, name="prompted"), "passage: "),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_option(zoo: Path, family: str, option: str) -> None:
    build, prompt = OPTIONS[option]
    build = dict(build)
    build.setdefault("pooling", "lasttoken" if family in DECODERS else "mean")
    build["name"] = f"st-{family}-{build.get('name', option)}"
    model_dir = sentence_transformers_dir(family, zoo, **build)
    ours = fleet_vectors(Encoder(str(model_dir), device="cpu"), texts(), prompt)
    theirs = reference(model_dir, texts(), **({"prompt": prompt} if prompt else {}))
    assert_parity(ours, theirs, f"{family} {build['pooling']} {option}")


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_hugging_face_directory(zoo: Path, family: str) -> None:
    """No modules.json: mean pooling (last token for a causal LM), not normalised, as
    sentence-transformers does."""
    model_dir = model_zoo.hf_model_dir(family, zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    assert encoder.pooling.modes == (("lasttoken",) if family in DECODERS else ("mean",))
    assert_parity(fleet_vectors(encoder, texts()), reference(model_dir, texts()), f"{family} hf")


# --- prompts as encode_query / encode_document choose them ----------------------------------
PROMPT_SETS = {
    "query+passage": (QUERY_PROMPTS, None),
    "query+document+default": (
        {"query": "query: ", "document": "document: ", "other": "other: "},
        "other",
    ),
    "default only": ({"classification": "classify: "}, "classification"),
}


@pytest.mark.parametrize("prompt_set", list(PROMPT_SETS))
@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_prompt_roles_match_encode_query_and_document(
    zoo: Path, family: str, prompt_set: str
) -> None:
    from sentence_transformers import SentenceTransformer

    prompts, default = PROMPT_SETS[prompt_set]
    model_dir = sentence_transformers_dir(
        family,
        zoo,
        pooling="lasttoken" if family in DECODERS else "mean",
        prompts=prompts,
        default_prompt_name=default,
        name=f"st-{family}-lanes-{len(prompts)}-{default}",
    )
    encoder = Encoder(str(model_dir), device="cpu")
    model = SentenceTransformer(str(model_dir), device="cpu")
    for role, encode in (("query", model.encode_query), ("document", model.encode_document)):
        prompt = encoder.resolve_prompt(role)
        ours = fleet_vectors(encoder, texts(), prompt)
        theirs = encode(texts(), batch_size=4)
        assert_parity(ours, theirs, f"{family} {prompt_set} {role} role (prompt {prompt!r})")
    # a named prompt, as a chunk's prompt_name
    name = next(iter(prompts))
    ours = fleet_vectors(encoder, texts(), encoder.resolve_prompt("document", prompt_name=name))
    assert_parity(ours, model.encode(texts(), prompt_name=name), f"{family} prompt_name={name}")


def test_prompt_tokens_count_against_the_maximum(zoo: Path) -> None:
    model_dir = sentence_transformers_dir("bert", zoo, prompts=QUERY_PROMPTS, name="st-bert-max")
    encoder = Encoder(str(model_dir), device="cpu")
    long_text = " ".join(corpus_lines()[:50])
    plain, prompted = encoder.tokenize([long_text]), encoder.tokenize([long_text], ["query: "])
    assert plain[0].length == prompted[0].length == encoder.max_length
    assert plain[0].ids[1:3] != prompted[0].ids[1:3]


def test_unknown_prompt_name_is_refused(zoo: Path) -> None:
    from embedfleet.shared import options
    from embedfleet.shared.dead_letters import DeadReason
    from embedfleet.workers.model.encoder import PromptError

    model_dir = sentence_transformers_dir("bert", zoo, prompts=QUERY_PROMPTS, name="st-bert-max")
    with pytest.raises(PromptError, match="'nope' is not one of the model's prompts") as refused:
        Encoder(str(model_dir), device="cpu").resolve_prompt("document", prompt_name="nope")
    # the verifier's own rule and error (shared/options.py), not a copy of it in the worker
    assert type(refused.value) is options.PromptError
    assert refused.value.code is DeadReason.OPTIONS


# --- refusal -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("module_type", "message"),
    [
        ("sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm", "LayerNorm"),
        ("sentence_transformers.sentence_transformer.modules.cnn.CNN", "cannot run a CNN"),
    ],
)
def test_unsupported_module_is_refused(
    zoo: Path, tmp_path: Path, module_type: str, message: str
) -> None:
    source = sentence_transformers_dir("bert", zoo)
    broken = model_zoo.with_extra_module(source, tmp_path / "broken", module_type)
    with pytest.raises(UnsupportedModelError, match=message):
        Encoder(str(broken), device="cpu")


def test_the_parity_check_can_fail(zoo: Path) -> None:
    """The matrix's bar separates pooling modes: mean vectors against cls vectors miss it."""
    mean_dir = sentence_transformers_dir("bert", zoo, pooling="mean")
    cls_dir = sentence_transformers_dir("bert", zoo, pooling="cls")
    ours = fleet_vectors(Encoder(str(mean_dir), device="cpu"), texts())
    assert cosines(ours, reference(cls_dir, texts())).min() < MIN_COSINE
