"""A store as its module declares it (embedfleet/sinks/store.py): its targets, a URL read into
one, and its extra required by name."""

from __future__ import annotations

import pytest

from embedfleet.sinks.backend import MissingExtraError
from embedfleet.sinks.store import Store
from embedfleet.sinks.target import SinkURL

TOY = Store(
    kind="toy",  # type: ignore[arg-type]
    schemes=("toy",),
    forms="toy:///DIR",
    describe="toy table {table!r} in {location}",
    extra="toy",
    needs=("json", "no_such_module_for_the_toy"),
)


def test_a_directory_url_becomes_a_described_target() -> None:
    target = TOY.read(SinkURL("toy:///data/t", "toy", "/data/t", "emb", ""))
    assert (target.kind, target.location, target.table) == ("toy", "/data/t", "emb")
    assert target.describe() == "toy table 'emb' in /data/t"


def test_a_missing_client_is_named_with_its_install_command() -> None:
    with pytest.raises(MissingExtraError) as caught:
        TOY.require()
    assert str(caught.value) == (
        "the toy sink needs no_such_module_for_the_toy: pip install 'embedfleet[toy]'"
    )
    Store("toy", ("toy",), "", "", needs=("json",)).require()  # type: ignore[arg-type]
