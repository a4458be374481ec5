"""Tiny random-weight models of every family the worker serves, built in seconds, no hub.

Each family: a ``transformers`` config (2 layers, hidden 32), a tokenizer trained by the
``tokenizers`` library on text that ships with Python (``pydoc_data``'s topic help: WordPiece for
the BERT class, Unigram for XLM-R, byte-level BPE for the decoder, which appends its EOS the way
Qwen3-Embedding's tokenizer does and pads on the left), saved as a Hugging Face directory.
:func:`sentence_transformers_dir` wraps one in sentence-transformers modules (Pooling mode,
``include_prompt``, Dense, Normalize, prompts) and saves it with sentence-transformers itself,
so the directory is exactly what a real published model looks like.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch
import transformers
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

FAMILIES = ("bert", "mpnet", "xlm-roberta", "distilbert", "modernbert", "qwen2", "qwen3")
VOCAB = 600
MAX_POSITIONS = 128


def corpus_lines() -> list[str]:
    """Text that ships with every Python: the interactive help's topic pages, as lines."""
    lines = []
    for key in sorted(topics):
        lines.extend(line.strip() for line in topics[key].splitlines() if line.strip())
    return lines


def sample_texts(start: int, step: int) -> list[str]:
    """Texts of every length for a model's parity: a word, a question, every ``step``-th of
    the corpus' first 4,000 lines from ``start``, and a text of its first 60 lines."""
    lines = corpus_lines()
    return [
        "hi",
        "What does the garbage collector do?",
        *lines[start:4000:step],
        " ".join(lines[:60]),
    ]


def _batches(lines: list[str], size: int = 1000) -> Iterator[list[str]]:
    for start in range(0, len(lines), size):
        yield lines[start : start + size]


def _wordpiece(cls: str, sep: str, pad: str, unk: str, mask: str, lowercase: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    specials = [pad, unk, cls, sep, mask] if pad != "<pad>" else [cls, pad, sep, unk, mask]
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=specials)
    tokenizer.train_from_iterator(_batches(corpus_lines()), trainer=trainer)
    tokenizer = _ids_in_one_order(tokenizer, len(specials))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",  # BERT's pair layout (cross-encoders)
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))],
    )
    return tokenizer


def _unigram() -> Tokenizer:
    """XLM-R's kind: SentencePiece-style Unigram over Metaspace pieces, <pad> at id 1."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.UnigramTrainer(vocab_size=VOCAB, special_tokens=specials, unk_token="<unk>")
    tokenizer.train_from_iterator(_batches(corpus_lines()), trainer=trainer)
    tokenizer = _ids_in_one_order(tokenizer, len(specials))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return tokenizer


def _ids_in_one_order(tokenizer: Tokenizer, specials: int) -> Tokenizer:
    """The trained ``tokenizer`` with its ids in the same order in every process. The WordPiece
    and Unigram trainers number the tokens they keep in a hash map's order, which Rust seeds per
    process: the same tokens got other ids in each test process, so the zoo's models (an
    embedding row per id) differed between runs, and a parity test near a tie failed at random
    (test_sparse_through_a_worker, one index of 530, stop 67). The special tokens, trained
    first, keep their ids; the rest follow by token (WordPiece) or by score, then piece
    (Unigram: its pieces' scores are what it tokenizes by)."""
    state = json.loads(tokenizer.to_str())
    model = state["model"]
    if model["type"] == "WordPiece":
        by_id = sorted(model["vocab"], key=model["vocab"].__getitem__)
        ordered = by_id[:specials] + sorted(by_id[specials:])
        model["vocab"] = {token: at for at, token in enumerate(ordered)}
    else:  # Unigram: [piece, score] rows, the row's index its id
        pieces = model["vocab"]
        model["vocab"] = pieces[:specials] + _scores_in_one_order(pieces[specials:])
    return Tokenizer.from_str(json.dumps(state))


def _scores_in_one_order(pieces: list[list[Any]]) -> list[list[Any]]:
    """Unigram's trained [piece, score] rows, sorted by score, then piece, the same in every
    process. Its scores, summed in hash order, differ in their last bits (1e-15: rounded away),
    and the characters it must keep get scores 1e-4 apart in hash order: within each run of
    scores under 2e-4 apart, the run's scores go to its pieces sorted."""
    rows = sorted(([piece, round(score, 6)] for piece, score in pieces), key=lambda r: -r[1])
    runs: list[list[list[Any]]] = []
    for row in rows:
        if runs and runs[-1][-1][1] - row[1] < 2e-4:
            runs[-1].append(row)
        else:
            runs.append([row])
    ordered: list[list[Any]] = []
    for run in runs:
        scores = [score for _, score in run]
        ordered += [
            [piece, score] for piece, score in zip(sorted(p for p, _ in run), scores, strict=True)
        ]
    return ordered


def _byte_level_bpe() -> Tokenizer:
    """Qwen's kind: byte-level BPE; the post-processor appends <|endoftext|> to every text,
    as Qwen3-Embedding's tokenizer does (its last-token pooling reads that EOS)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_batches(corpus_lines()), trainer=trainer)
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
            ),
        ]
    )
    return tokenizer


def _special_token_names(
    cls: str, sep: str, pad: str, unk: str, mask: str, *, bos_eos: bool = False
) -> dict[str, str]:
    """The special-token arguments of PreTrainedTokenizerFast; ``bos_eos``: RoBERTa's way (MPNet,
    XLM-R), where the CLS and SEP tokens are also BOS and EOS."""
    names = dict(cls_token=cls, sep_token=sep, pad_token=pad, unk_token=unk, mask_token=mask)
    if bos_eos:
        names.update(bos_token=cls, eos_token=sep)
    return names


def _fast_tokenizer(family: str) -> PreTrainedTokenizerFast:
    if family in ("bert", "distilbert", "modernbert"):
        specials = ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]")
        raw = _wordpiece(*specials, lowercase=True)
        names = _special_token_names(*specials)
    elif family == "mpnet":  # MPNet uses <s> </s> and <pad> at id 1 around a WordPiece vocab
        specials = ("<s>", "</s>", "<pad>", "[UNK]", "<mask>")
        raw = _wordpiece(*specials, lowercase=True)
        names = _special_token_names(*specials, bos_eos=True)
    elif family == "xlm-roberta":
        raw = _unigram()
        names = _special_token_names("<s>", "</s>", "<pad>", "<unk>", "<mask>", bos_eos=True)
    else:
        raw = _byte_level_bpe()
        names = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    side = "left" if family in ("qwen2", "qwen3") else "right"
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, model_max_length=MAX_POSITIONS, padding_side=side, **names
    )


def _config(family: str, tokenizer: PreTrainedTokenizerFast) -> transformers.PretrainedConfig:
    vocab = len(tokenizer)
    pad = tokenizer.pad_token_id
    small = dict(vocab_size=vocab, num_hidden_layers=2, num_attention_heads=2, pad_token_id=pad)
    if family == "bert":
        return transformers.BertConfig(
            hidden_size=32, intermediate_size=64, max_position_embeddings=MAX_POSITIONS, **small
        )
    if family == "mpnet":
        return transformers.MPNetConfig(
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=MAX_POSITIONS + 2,  # positions start after padding_idx
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **small,
        )
    if family == "xlm-roberta":
        return transformers.XLMRobertaConfig(
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=MAX_POSITIONS + 2,
            bos_token_id=0,
            eos_token_id=2,
            **small,
        )
    if family == "distilbert":
        return transformers.DistilBertConfig(
            vocab_size=vocab,
            dim=32,
            hidden_dim=64,
            n_layers=2,
            n_heads=2,
            max_position_embeddings=MAX_POSITIONS,
            pad_token_id=pad,
        )
    if family == "modernbert":
        return transformers.ModernBertConfig(
            hidden_size=32,
            intermediate_size=64,
            max_position_embeddings=MAX_POSITIONS,
            local_attention=16,
            global_attn_every_n_layers=2,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
            **small,
        )
    config_class = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    return config_class(
        hidden_size=32,
        intermediate_size=64,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        architectures=[f"{config_class.__name__.removesuffix('Config')}ForCausalLM"],
        **small,
    )


@functools.cache
def _trained_tokenizer(family: str) -> PreTrainedTokenizerFast:
    return _fast_tokenizer(family)


def hf_model_dir(family: str, root: Path) -> Path:
    """A plain Hugging Face directory of ``family`` (config, weights, tokenizer) under root."""
    target = root / f"hf-{family}"
    if (target / "config.json").is_file():
        return target
    tokenizer = _trained_tokenizer(family)
    config = _config(family, tokenizer)
    model = wide_random_model(transformers.AutoModel.from_config, config, family_seed(family))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    if family in ("qwen2", "qwen3"):
        # as published (a causal-LM checkpoint): save_pretrained wrote the base class's name
        config_file = target / "config.json"
        config = json.loads(config_file.read_text())
        config["architectures"] = [type(model).__name__.replace("Model", "ForCausalLM")]
        config_file.write_text(json.dumps(config, indent=2))
    return target


def sentence_transformers_dir(
    family: str,
    root: Path,
    *,
    pooling: str | tuple[str, ...] = "mean",
    include_prompt: bool = True,
    dense: int | None = None,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    max_seq_length: int = 48,
    name: str | None = None,
) -> Path:
    """A sentence-transformers directory of ``family`` with the modules asked for, saved by
    sentence-transformers itself (Transformer at the root, modules in numbered folders)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf_dir = hf_model_dir(family, root)
    name = name or f"st-{family}-{'+'.join([pooling] if isinstance(pooling, str) else pooling)}"
    target = root / name
    if (target / "modules.json").is_file():
        return target
    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    hidden = transformer.get_embedding_dimension()
    modules: list[torch.nn.Module] = [
        transformer,
        Pooling(hidden, pooling_mode=pooling, include_prompt=include_prompt),
    ]
    width = hidden * (1 if isinstance(pooling, str) else len(pooling))
    if dense is not None:
        torch.manual_seed(7)
        modules.append(Dense(width, dense, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(
        modules=modules, prompts=prompts, default_prompt_name=default_prompt_name, device="cpu"
    )
    model.save(str(target), create_model_card=False)  # its Jinja card: a third of a build
    return target


def with_extra_module(source: Path, target: Path, module_type: str) -> Path:
    """A copy of ``source`` with one more module appended to modules.json (for refusals)."""
    shutil.copytree(source, target)
    modules = json.loads((target / "modules.json").read_text())
    modules.append(
        {"idx": len(modules), "name": str(len(modules)), "path": "", "type": module_type}
    )
    (target / "modules.json").write_text(json.dumps(modules))
    return target


Builder = Callable[..., Path]


def family_seed(family: str) -> int:
    """The seed of a family's random weights: the same weights every run."""
    return sum(map(ord, family))


def wide_random_model(
    build: Callable[[transformers.PretrainedConfig], Any],
    config: transformers.PretrainedConfig,
    seed: int,
) -> Any:
    """``build(config)`` (a model class, or ``AutoModel.from_config``) with random weights wide
    enough that texts differ clearly (the init's are small: hidden states would differ little
    between texts), in eval mode. The same ``seed`` gives the same weights."""
    torch.manual_seed(seed)
    model = build(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    return model.eval()


def _head_model_dir(
    hf_dir: Path,
    family: str,
    model_class: type,
    seed: int,
    configure: Callable[[transformers.PretrainedConfig], None] = lambda config: None,
) -> Path:
    """A Hugging Face directory at ``hf_dir``: ``model_class`` on ``family``'s config (changed
    by ``configure``) with ``wide_random_model``'s weights, and the family's tokenizer; made
    once, kept when it is there."""
    if not (hf_dir / "config.json").is_file():
        tokenizer = _trained_tokenizer(family)
        config = _config(family, tokenizer)
        configure(config)
        wide_random_model(model_class, config, seed).save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
    return hf_dir


def splade_dir(
    root: Path, *, strategy: str = "max", activation: str = "relu", modern: bool = False
) -> Path:
    """A SPLADE ``SparseEncoder`` directory (BERT with its MLM head, then SpladePooling),
    saved by sentence-transformers itself; ``modern``: its first module a ``Transformer`` with
    ``transformer_task="fill-mask"`` (sentence-transformers 6's way) instead of the
    ``MLMTransformer`` published SPLADE models have."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    target = root / f"splade-{strategy}-{activation}{'-modern' if modern else ''}"
    if (target / "modules.json").is_file():
        return target
    hf_dir = _head_model_dir(root / "hf-bert-mlm", "bert", transformers.BertForMaskedLM, 11)
    modules = [
        Transformer(str(hf_dir), transformer_task="fill-mask")
        if modern
        else MLMTransformer(str(hf_dir)),
        SpladePooling(pooling_strategy=strategy, activation_function=activation),  # type: ignore[arg-type]
    ]
    SparseEncoder(modules=modules, device="cpu").save(str(target), create_model_card=False)
    return target


def cross_encoder_dir(root: Path, *, num_labels: int = 1) -> Path:
    """A ``CrossEncoder`` directory (BERT with a classification head), saved by
    sentence-transformers itself."""
    from sentence_transformers import CrossEncoder

    target = root / f"cross-encoder-{num_labels}"
    if (target / "modules.json").is_file():
        return target

    def with_labels(config: transformers.PretrainedConfig) -> None:
        config.num_labels = num_labels

    hf_dir = _head_model_dir(
        root / f"hf-bert-cls-{num_labels}",
        "bert",
        transformers.BertForSequenceClassification,
        13,
        with_labels,
    )
    # as BERT's tokenizer declares them: pairs carry segment ids (0 query, 1 document)
    tokenizer_config = hf_dir / "tokenizer_config.json"
    declared = json.loads(tokenizer_config.read_text())
    declared["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    tokenizer_config.write_text(json.dumps(declared, indent=2))
    CrossEncoder(str(hf_dir), device="cpu").save(str(target), create_model_card=False)
    return target


def classified_alone(model_dir: Path, texts: list[str]) -> Any:
    """A cross-encoder directory's scores of each text alone, one sequence, as the transformers
    text-classification pipeline (and TEI's single-text /predict) computes them: the tokenizer
    called on the text alone, cut to the CrossEncoder's maximum, AutoModelForSequenceClassification,
    then the CrossEncoder's activation. A numpy array (texts, labels)."""
    from sentence_transformers import CrossEncoder

    cross_encoder = CrossEncoder(str(model_dir), device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    rows = []
    with torch.no_grad():
        for text in texts:  # one at a time: no padding in the reference
            encoded = tokenizer(
                text, truncation=True, max_length=cross_encoder.max_seq_length, return_tensors="pt"
            )
            rows.append(cross_encoder.activation_fn(model(**encoded).logits.float())[0])
    return torch.stack(rows).numpy()


def bge_m3_dir(
    root: Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    colbert_dim: int | None = None,
    max_seq_length: int = 48,
) -> Path:
    """A BGE-M3-shaped directory: an XLM-R (``hidden`` wide, ``layers`` deep, random weights)
    saved by sentence-transformers as Transformer + CLS Pooling + Normalize, with FlagEmbedding's
    ``sparse_linear.pt`` (hidden -> 1) and ``colbert_linear.pt`` (hidden -> ``colbert_dim``,
    default hidden) beside modules.json, as BAAI/bge-m3 ships them."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    colbert_dim = colbert_dim or hidden
    target = root / f"bge-m3-{hidden}x{layers}-c{colbert_dim}-{max_seq_length}"
    if (target / "colbert_linear.pt").is_file():
        return target

    def sized(config: transformers.PretrainedConfig) -> None:
        config.hidden_size, config.num_hidden_layers = hidden, layers
        config.intermediate_size = 4 * hidden
        config.num_attention_heads = max(2, hidden // 64)

    hf_dir = _head_model_dir(
        root / f"hf-xlm-roberta-{hidden}x{layers}",
        "xlm-roberta",
        transformers.XLMRobertaModel,
        19,
        sized,
    )
    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    modules = [transformer, Pooling(hidden, pooling_mode="cls"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(target), create_model_card=False)
    torch.manual_seed(23)
    for file, width in (("sparse_linear.pt", 1), ("colbert_linear.pt", colbert_dim)):
        head = torch.nn.Linear(hidden, width)
        with torch.no_grad():
            head.weight.normal_(0.0, 0.3)
            head.bias.normal_(0.0, 0.1)
        torch.save(head.state_dict(), target / file)
    return target


def bert_shaped_dir(
    source: Path,
    target: Path,
    *,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float16,
) -> Path:
    """A sentence-transformers directory shaped like a bigger BERT (BERT-base: 768 / 12 / 12 /
    3072; BGE-large: 1024 / 24 / 16 / 4096), for speed runs only: ``source``'s tokenizer, config
    (vocabulary, positions) and modules (a published directory: the packaged all-MiniLM-L6-v2 or
    the device carry's fp16 copy of it), a ``BertModel`` of the given sizes with transformers' own
    random initialisation (built on ``device``, saved in ``dtype``), the Pooling module widened.
    Texts tokenize exactly as for the source, so token counts match its runs. The GPU check
    builds these on the device machine (loadtest/gpu_steps.py): their weights (0.2 and 0.7 GB in
    fp16) do not fit the device carry. Made once, kept when it is there."""
    if (target / "model.safetensors").is_file():
        return target
    weights = ("*.safetensors", "*.bin", "*.pt", "onnx", "openvino")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*weights), dirs_exist_ok=True)
    config = transformers.BertConfig.from_pretrained(source)
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.num_attention_heads, config.intermediate_size = heads, intermediate
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.BertModel(config)  # with the pooler its loader expects
    torch.nn.Module.to(model, dtype)  # (transformers' own `to` is typed for devices only)
    model.eval().save_pretrained(target)  # config.json (the new sizes) and the weights
    for module in json.loads((target / "modules.json").read_text()):
        if module["type"].endswith("Pooling"):
            pooling = target / module["path"] / "config.json"
            settings = json.loads(pooling.read_text())
            settings["word_embedding_dimension"] = hidden
            pooling.write_text(json.dumps(settings, indent=2))
    return target
