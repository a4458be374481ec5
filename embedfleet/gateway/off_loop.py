"""Work that grows with a request runs off the event loop: ``await off_loop(work, ...)``.

Tokenizing, counting tokens, decoding token ids and checking a body's texts take time in
proportion to the request: 2,048 inputs of 8,000 characters are seconds of tokenizing. On the
event loop that would hold /healthz (the liveness probe) and every other request for as long, so
every route's checks and counts (``inputs.prepare``, ``check_context``, ``fit_to_model``, the
``usage`` and TEI's ``x-compute-tokens``) go through this one helper, which runs them on a worker
thread (the ``tokenizers`` package releases the GIL while it encodes a batch). Anything that
stays on the loop is bounded by a constant, not by the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def off_loop(work: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``work(*args, **kwargs)`` on a worker thread (asyncio's default executor), awaited; its
    exception is raised here, as if it had been called in place."""
    return await asyncio.to_thread(work, *args, **kwargs)
