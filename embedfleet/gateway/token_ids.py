"""Token ids in a request's ``input``: whose ids they are, and the text they stand for.

A list of integers says nothing of the tokenizer that made it. The gateway reads ids only where a
setting says whose they are: EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS, the served model's own (its
``ModelTokenizer``); EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING, a tiktoken encoding's (``TiktokenIds``:
LangChain's ``OpenAIEmbeddings`` sends ``cl100k_base``'s ids by default). Either way the ids are
decoded to text and the workers embed the text, so the vector is the model's for what the client
meant, never the model's for the same numbers read in its own vocabulary.

An encoding named (``cl100k_base``) is read from tiktoken's cache and never downloaded: the
gateway sends nothing anywhere (docs/DESIGN's qualities). An encoding in a file (``.tiktoken``,
tiktoken's own format: a base64 token and its rank a line) is read from that file.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the gateway extra's; imported when the setting names an encoding
    import tiktoken

# an encoding given as a file: no special tokens, and a split pattern that only encoding uses
# (the gateway decodes ids; it never encodes text with it)
FILE_PATTERN = r"\S+|\s+"


class IdDecoder(Protocol):
    """Whatever reads one tokenizer's ids back into text."""

    @property
    def vocab_size(self) -> int: ...

    def decode(self, ids: list[int]) -> str: ...


class TiktokenNotCached(RuntimeError):
    """The encoding's file is not in tiktoken's cache, and the gateway downloads nothing."""


@dataclass(frozen=True)
class TiktokenIds:
    """A tiktoken encoding's ids, decoded to text."""

    encoding: tiktoken.Encoding

    @property
    def name(self) -> str:
        return self.encoding.name

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (invalid UTF-8 replaced, as tiktoken decodes); ValueError for an
        id the encoding does not have (a gap in its ranks)."""
        try:
            return self.encoding.decode(ids)
        except KeyError as error:  # tiktoken's "Invalid token for decoding: N"
            raise ValueError(str(error.args[0] if error.args else error)) from None


def tiktoken_ids_of(spec: str | None) -> TiktokenIds | None:
    """EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING's encoding (None: unset), read at start;
    TiktokenSettingError naming the setting and what to do when it cannot be read."""
    if not spec:
        return None
    try:
        return load_tiktoken_ids(spec)
    except ImportError:
        raise TiktokenSettingError(
            f"EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING={spec!r} needs the tiktoken package: "
            "pip install 'embedfleet[gateway]' (or pip install tiktoken)"
        ) from None
    except (TiktokenNotCached, ValueError, OSError) as error:
        raise TiktokenSettingError(
            f"EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING={spec!r}: {error}"
        ) from None


class TiktokenSettingError(ValueError):
    """EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING names an encoding the gateway cannot read."""


def load_tiktoken_ids(spec: str) -> TiktokenIds:
    """EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING's encoding: the path of a ``.tiktoken`` file, else a
    name tiktoken knows, read from its cache (TiktokenNotCached if it is not there). ValueError
    for a name tiktoken does not know; ImportError without the tiktoken package."""
    import tiktoken

    path = Path(spec)
    if path.suffix == ".tiktoken" or path.is_file():
        return TiktokenIds(
            tiktoken.Encoding(
                name=path.stem,
                pat_str=FILE_PATTERN,
                mergeable_ranks=read_ranks(path),
                special_tokens={},
            )
        )
    with _no_download(spec):
        return TiktokenIds(tiktoken.get_encoding(spec))


def read_ranks(path: Path) -> dict[bytes, int]:
    """A ``.tiktoken`` file's ranks (tiktoken's format: ``<base64 token> <rank>`` a line),
    read here rather than with ``tiktoken.load.load_tiktoken_bpe``, which copies the file into
    tiktoken's cache folder; ValueError naming the line for a malformed one."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(
                f"{path}:{number}: not a tiktoken rank line (`<base64 token> <rank>`)"
            ) from None
    return ranks


@contextlib.contextmanager
def _no_download(name: str) -> Iterator[None]:
    """tiktoken with its downloads refused: ``tiktoken.load.read_file`` is the one place it
    fetches a URL (``read_file_cached`` calls it when the cache misses); local paths pass. Used
    once, at start, before the gateway serves."""
    import tiktoken.load

    fetch = tiktoken.load.read_file

    def cached_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise TiktokenNotCached(
                f"the tiktoken encoding {name!r} is not in tiktoken's cache, and the gateway "
                f"downloads nothing. Put its file ({blobpath}) there: run "
                f"`python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"` with "
                "TIKTOKEN_CACHE_DIR set where the gateway reads it (a volume), and start the "
                "gateway with the same TIKTOKEN_CACHE_DIR; or give "
                "EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING the path of the .tiktoken file"
            )
        return fetch(blobpath)

    tiktoken.load.read_file = cached_only
    try:
        yield
    finally:
        tiktoken.load.read_file = fetch
