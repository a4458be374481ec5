"""The model's own tokenizer without torch: counting, decoding and splitting need only
``tokenizer.json`` (the ``tokenizers`` package, in the ``[documents]`` and ``[gateway]`` extras).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from embedfleet.shared.modeldir import ModelFiles
from embedfleet.shared.tokens import counting_head

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def load_tokenizer(files: ModelFiles) -> Tokenizer:
    """The model directory's fast tokenizer, untruncated and unpadded."""
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ImportError(
            "the model's tokenizer needs the tokenizers package: "
            "pip install 'embedfleet[documents]' (or [gateway])"
        ) from error
    path = files.path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{files.path} has no tokenizer.json (a fast tokenizer is needed)")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class ModelTokenizer:
    """Token counts as the worker sees them (special tokens included, capped at the maximum)."""

    def __init__(self, files: ModelFiles) -> None:
        self.files = files
        self.tokenizer = load_tokenizer(files)
        # [CLS] ... [SEP] for BERT, <s> ... </s> for RoBERTa, maybe only EOS for a decoder
        self.special_tokens = len(self.tokenizer.encode("", add_special_tokens=True).ids)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def max_length(self) -> int:
        return self.files.max_length

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text with special tokens, before truncation."""
        encodings = self.tokenizer.encode_batch(
            [counting_head(text, self.max_length) for text in texts]
        )
        return [len(encoding.ids) for encoding in encodings]

    def usage(self, texts: Sequence[str]) -> int:
        """Tokens the model reads for these texts: each text's length capped at the maximum."""
        return sum(min(n, self.max_length) for n in self.lengths(texts))

    def prompt_tokens(self, prompt: str) -> int:
        """Tokens a prompt adds in front of a text (without special tokens)."""
        return len(self.tokenizer.encode(prompt, add_special_tokens=False).ids) if prompt else 0

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped: what the worker re-tokenizes."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
