"""Progress for the command line: a bar on a terminal, a log line per interval anywhere else.

On a terminal a tqdm bar on stderr; log lines written meanwhile go above it
(``shared.logging.BarAwareStderr``). Redirected to a file or a pipe, a bar would leave one
``\\r`` frame after another in the file, so instead one summary line is logged every
``interval_s`` seconds and one when the work ends.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.progress")

PROGRESS_LOG_INTERVAL_S = 10.0


class Progress:
    """Counts work done (``update`` adds, ``set`` replaces) and shows it; a context manager."""

    def __init__(
        self,
        desc: str,
        unit: str,
        total: int | None = None,
        *,
        interval_s: float = PROGRESS_LOG_INTERVAL_S,
        bar: bool | None = None,
    ) -> None:
        """``bar``: None picks from stderr (a terminal gets the bar); True/False forces it."""
        self.desc = desc
        self.unit = unit
        self.total = total
        self.done = 0
        self.interval_s = interval_s
        self._started = time.monotonic()
        self._last_line = self._started
        use_bar = sys.stderr.isatty() if bar is None else bar
        self._bar: tqdm | None = (
            tqdm(total=total, desc=desc, unit=f" {unit}", file=sys.stderr) if use_bar else None
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(finished=exc_type is None)  # an exception: the work did not finish

    def update(self, count: int = 1) -> None:
        self.set(self.done + count)

    def set(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.n = done
            self._bar.refresh()
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval_s:
            self._last_line = now
            log.info(self.desc, **self._figures(now))

    def close(self, *, finished: bool = True) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif finished:
            log.info(f"{self.desc}: finished", **self._figures(time.monotonic()))

    def _figures(self, now: float) -> dict[str, object]:
        elapsed = now - self._started
        figures: dict[str, object] = {self.unit: self.done}
        if self.total is not None:
            figures["total"] = self.total
        figures["per_s"] = round(self.done / elapsed, 1) if elapsed > 0 else None
        figures["elapsed_s"] = round(elapsed, 1)
        return figures
