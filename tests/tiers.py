"""The test tiers: the markers `make test` leaves out, owned here. The Makefile's fast tier is
``python3 -m tests.tiers`` (its ``-m`` expression); tests/conftest.py checks that a test which
starts an `embedfleet worker` process, or is marked ``serial``, carries one of them. Nothing is
imported here: the Makefile runs it with any Python, before the venv exists."""

# slow: starts worker or gateway processes or other servers, or compiles a model (pyproject.toml
# describes each marker)
SLOW_TIERS: tuple[str, ...] = ("slow", "chaos", "image", "packaging", "cluster")
FAST_TIER = " and ".join(f"not {tier}" for tier in SLOW_TIERS)

if __name__ == "__main__":
    print(FAST_TIER)
