"""The model's own tokenizer without torch: counting, decoding and splitting need only
``tokenizer.json`` (the ``tokenizers`` package, in the ``[documents]`` and ``[gateway]`` extras).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from embedfleet.shared.tokens import counting_head

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def _tokenizer_class() -> type[Tokenizer]:
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ImportError(
            "the model's tokenizer needs the tokenizers package: "
            "pip install 'embedfleet[documents]' (or [gateway])"
        ) from error
    return Tokenizer


def load_tokenizer(model_dir: Path | None, *, json_text: str | None = None) -> Tokenizer:
    """The model directory's fast tokenizer (or the one ``json_text`` holds, a
    ``tokenizer.json`` a model lane's workers published), untruncated and unpadded."""
    tokenizer_class = _tokenizer_class()
    if json_text is not None:
        tokenizer = tokenizer_class.from_str(json_text)
    else:
        if model_dir is None:
            raise ValueError("a model directory or a tokenizer.json's text is needed")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{model_dir} has no tokenizer.json (a fast tokenizer is needed)"
            )
        tokenizer = tokenizer_class.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class ModelTokenizer:
    """Token counts as the worker sees them (special tokens included, capped at the maximum).

    The maximum is the model card's (``max_length``, published by the workers), passed in by
    the caller: the tokenizer file does not say what the worker cuts at."""

    def __init__(self, model_dir: Path | None, *, json_text: str | None = None) -> None:
        self.tokenizer = load_tokenizer(model_dir, json_text=json_text)
        # [CLS] ... [SEP] for BERT, <s> ... </s> for RoBERTa, maybe only EOS for a decoder
        self.special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_json(cls, json_text: str) -> ModelTokenizer:
        """The tokenizer of a ``tokenizer.json``'s text (what a model lane's workers publish,
        ``Keys.tokenizer``): the gateway's for a model whose files it does not have."""
        return cls(None, json_text=json_text)

    def lengths(self, texts: Sequence[str], max_length: int) -> list[int]:
        """Tokens of each text with special tokens, before truncation; exact up to
        ``max_length``, and over it for any text longer than that."""
        encodings = self.tokenizer.encode_batch([counting_head(text, max_length) for text in texts])
        return [len(encoding.ids) for encoding in encodings]

    def usage(self, texts: Sequence[str], max_length: int) -> int:
        """Tokens the model reads for these texts: each text's length capped at ``max_length``."""
        return sum(min(n, max_length) for n in self.lengths(texts, max_length))

    def prompt_tokens(self, prompt: str) -> int:
        """Tokens a prompt adds in front of a text (without special tokens)."""
        return len(self.tokenizer.encode(prompt, add_special_tokens=False).ids) if prompt else 0

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped: what the worker re-tokenizes."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
