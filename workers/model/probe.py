"""``python -m embedfleet.workers.model.probe``: load the configured model with
EMBEDFLEET_DTYPE=auto and print the parity probe's verdict (workers/model/precision.py)."""

from __future__ import annotations

from embedfleet.shared.settings import load_settings
from embedfleet.workers.model.encoder import Encoder


def main() -> None:
    """Load the configured model with EMBEDFLEET_DTYPE=auto and print the probe's verdict."""
    settings = load_settings()
    encoder = Encoder(
        settings.model, device=settings.device, dtype="auto", threads=settings.threads
    )
    report = encoder.parity
    print(report.line() if report else f"precision auto: {encoder.precision.describe()} (no probe)")


if __name__ == "__main__":
    main()
