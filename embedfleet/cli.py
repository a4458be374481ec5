"""The `embedfleet` command line: one click group, `main`, and the one place its verbs are
registered (below, one line each). Each verb's command is defined once, in the module that owns
what the verb does; no other module registers a verb."""

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


# The one place the verbs are registered, one line each; each verb's command lives in the
# module that owns what it does. --help lists them by name, whatever the order here.
main.add_command(demo_command)  # embedfleet.demo: the whole fleet on one machine
main.add_command(worker_command)  # embedfleet.workers.cli
main.add_command(serve_command)  # embedfleet.gateway.cli: the HTTP gateway
main.add_command(enqueue_command)  # embedfleet.ops.client_verbs: the client's verbs ...
main.add_command(query_command)
main.add_command(results_command)
main.add_command(calibration_command)
main.add_command(status_command)  # embedfleet.ops.status
main.add_command(plan_command)  # embedfleet.ops.plan
main.add_command(dead_group)  # embedfleet.ops.dead_letter_admin: dead list/show/replay/purge
main.add_command(search_command)  # embedfleet.ops.search: the vector database sinks' verbs ...
main.add_command(index_command)
main.add_command(migrate_group)  # embedfleet.ops.migrate_cli: migrate start/status/.../finish
main.add_command(prune_command)  # embedfleet.ops.prune


if __name__ == "__main__":
    main()
