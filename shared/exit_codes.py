"""The exit statuses of every `embedfleet` verb, in one place (the README's table is this one).

Scripts and supervisors branch on them: a job that finished with dead letters is not a failure
to retry (its letters wait in the dead-letter stream for `embedfleet dead replay`), and a file
with bad lines was enqueued in part, so neither shares a status with an error.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    """Done: everything asked for was done."""
    ERROR = 1
    """Stopped with a message on stderr: Redis unreachable, a timeout, a bad setting, a worker
    that cannot serve its model."""
    USAGE = 2
    """A wrong command line (an unknown verb or flag, a flag that needs another)."""
    DEAD_LETTERS = 3
    """`enqueue --wait`: the job finished, but some chunks were dead-lettered (`embedfleet dead
    list --job JOB` shows them, `embedfleet dead replay` re-sends them once fixed)."""
    REJECTED_LINES = 4
    """`enqueue`: some input lines were rejected (printed with their line numbers); every good
    line was enqueued."""


def exit_codes_table() -> str:
    """The Markdown table of the exit statuses, from the docstrings above."""
    import ast
    import inspect
    from itertools import pairwise

    source = ast.parse(inspect.getsource(ExitCode))
    meaning: dict[str, str] = {}
    body = source.body[0].body  # type: ignore[attr-defined]
    for statement, following in pairwise(body):
        if isinstance(statement, ast.Assign) and isinstance(following, ast.Expr):
            name = statement.targets[0].id  # type: ignore[attr-defined]
            meaning[name] = " ".join(str(following.value.value).split())  # type: ignore[attr-defined]
    rows = ["| status | name | meaning |", "|---:|---|---|"]
    rows += [f"| {code.value} | `{code.name}` | {meaning[code.name]} |" for code in ExitCode]
    return "\n".join(rows)


if __name__ == "__main__":
    print(exit_codes_table())
