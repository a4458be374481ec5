"""Where the tests find the repository: one constant, so a test module can move between the
tiers' folders (tests/unit, tests/integration, tests/end_to_end) without counting parents."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
