"""What the vector cache costs a corpus it has never seen: the fleet with its defaults, cache on
(every text a miss, looked up and then stored) against cache off (EMBEDFLEET_VECTOR_CACHE_MB=0),
alternating A B, B A over the rounds, each run on texts new to the fleet
(loadtest.corpus.FreshCorpora), with the Redis server's CPU seconds per run beside.

``loadtest.bench`` has the same two rows among many contenders, with sentence-transformers'
40-second rounds between them; this is the pair alone, so the rounds sit close together.

    python -m loadtest.cache_cost --texts 2400 --rounds 6
"""

from __future__ import annotations

import os
import statistics

import click

from embedfleet.server import ServerProcess
from embedfleet.workers.cpus import usable_cpus
from loadtest.bench import FLEET_VARIANTS, Fleet, FleetEncoders, machine_line, settings_overrides
from loadtest.corpus import FreshCorpora

# the bench's own rows for the pair (their settings said once, there)
VARIANTS: dict[str, dict[str, object]] = {
    name: settings_overrides(variant.env)
    for variant in FLEET_VARIANTS
    for name, row in (("cache on", "fleet auto"), ("cache off", "fleet auto cache off"))
    if variant.name == row
}


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux: /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        # the fields after the command's parenthesised name; utime and stime are 14th and 15th
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@click.command()
@click.option("--texts", default=2400, show_default=True, help="Texts per run.")
@click.option("--rounds", default=6, show_default=True, help="Pairs of runs (A B, then B A).")
@click.option("--seed", default=0, show_default=True, help="The fresh corpora's seed.")
def main(texts: int, rounds: int, seed: int) -> None:
    """Cache on against cache off on new texts, alternating; per-round ratios and their
    median."""
    click.echo(f"machine: {machine_line()}", err=True)
    corpora = FreshCorpora(texts, seed=seed)
    encoder = FleetEncoders("auto", usable_cpus()).encoder({})
    click.echo(f"forward path: {encoder.forward_path}", err=True)
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with ServerProcess() as server:
        assert server.process is not None
        server_pid = server.process.pid
        fleet = Fleet(server.url, vector_cache=True)
        for name, overrides in VARIANTS.items():  # warm-up: the worker's first batches
            warm = corpora.corpus(f"warm-up/{name}", min(64, texts))
            fleet.run(
                encoder, [t.text for t in warm], [t.id for t in warm], False, settings=overrides
            )
        for number in range(rounds):
            order = list(VARIANTS) if number % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                corpus = corpora.corpus(f"round {number + 1}/{name}")
                before = cpu_seconds(server_pid)
                run = fleet.run(
                    encoder,
                    [t.text for t in corpus],
                    [t.id for t in corpus],
                    False,
                    settings=VARIANTS[name],
                )
                server_cpu = cpu_seconds(server_pid) - before
                if run.cache_hits:
                    raise click.ClickException(f"{name}: {run.cache_hits} texts were not new")
                rates[name].append(run.texts / run.seconds)
                click.echo(
                    f"round {number + 1}/{rounds} {name}: {rates[name][-1]:.1f} texts/s, "
                    f"the server's CPU {server_cpu:.2f} s"
                )
    ratios = [off / on for on, off in zip(rates["cache on"], rates["cache off"], strict=True)]
    click.echo(
        "cache off / cache on per round: "
        + " ".join(f"{ratio:.3f}" for ratio in ratios)
        + f"; median {statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
