"""workers/windows.py, a window's own bookkeeping: the rows it keeps after a set-aside, and the
entries it answers (embedded and from the vector cache). The opening itself runs the tokenizer
and Redis: tests/integration/workers/test_bulk.py and test_long_inputs.py."""

from __future__ import annotations

import numpy as np

from embedfleet.shared.protocol import Chunk, Result
from embedfleet.sinks import Delivery
from embedfleet.workers.images import ImageRows
from embedfleet.workers.model.tokenizer import Tokenized
from embedfleet.workers.windows import Window


def rows(count: int) -> Window:
    return Window(
        [Chunk(id=str(i), text="t") for i in range(count)],
        [Delivery("ingest", f"{i}-0", None) for i in range(count)],
        [Tokenized([i], False) for i in range(count)],
    )


def test_kept_holds_only_the_rows_named_in_order() -> None:
    window = rows(4)
    kept = window.kept([0, 3])
    assert [c.id for c in kept.chunks] == ["0", "3"]
    assert [d.entry_id for d in kept.deliveries] == ["0-0", "3-0"]
    assert [t.ids for t in kept.tokens] == [[0], [3]]
    assert len(window.chunks) == 4  # the window itself is left as it was


def test_held_is_every_entry_the_window_answers() -> None:
    window = rows(2)
    hit = Delivery("ingest", "9-0", None)
    result = Result(id="c", model="m", vector=np.zeros(2, dtype=np.float16))
    window.cached.append((Chunk(id="c", text="t"), hit, result))
    assert window.held == [*window.deliveries, hit]


def test_a_window_of_images_alone_is_not_empty() -> None:
    # issue 56: the intake dropped such a window, and its entries stayed pending for ever
    assert Window([], [], []).empty and not rows(1).empty
    picture = Delivery("ingest", "5-0", None)
    images = ImageRows(
        [Chunk(id="p", image=b"\x89PNG")], [picture], np.zeros((1, 3, 2, 2), np.float32), {}
    )
    window = Window([], [], [], images=images)
    assert not window.empty and window.held == [picture]
