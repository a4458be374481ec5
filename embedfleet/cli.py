"""The `embedfleet` command line."""

from __future__ import annotations

import click

from embedfleet.demo import demo_command
from embedfleet.gateway.cli import serve_command
from embedfleet.ops.client_verbs import (
    calibration_command,
    enqueue_command,
    query_command,
    results_command,
)
from embedfleet.ops.dead_letter_admin import dead_group
from embedfleet.ops.migrate_cli import migrate_group
from embedfleet.ops.plan import plan_command
from embedfleet.ops.prune import prune_command
from embedfleet.ops.search import index_command, search_command
from embedfleet.ops.status import status_command
from embedfleet.shared.verbosity import verbose_option
from embedfleet.workers.cli import worker_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="embedfleet")
@verbose_option
def main() -> None:
    """embedfleet: bulk text embedding with Redis Streams as a durable queue.

    Producers enqueue chunks to {namespace}:ingest; workers embed them and write fp16 vectors
    to {namespace}:results. Settings come from EMBEDFLEET_* environment variables (see README).
    Start with `embedfleet demo`.
    """


for command in (
    demo_command,
    worker_command,
    enqueue_command,
    query_command,
    results_command,
    status_command,
    calibration_command,
    plan_command,
    serve_command,
    dead_group,
):
    main.add_command(command)
for command in (
    search_command,
    index_command,
    migrate_group,
    prune_command,
):  # the vector database sinks
    main.add_command(command)


if __name__ == "__main__":
    main()
