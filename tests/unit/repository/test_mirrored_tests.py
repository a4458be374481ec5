"""Tests mirror the code (issue 55): a module ``<package>/<path>/foo.py`` of the packages below
has its ``tests/unit/<mirror>/<path>/test_foo.py`` or ``tests/integration/<mirror>/<path>/
test_foo.py``, so a newcomer finds a module's tests by its name, as in Infinity's unit_test/."""

from __future__ import annotations

from pathlib import Path

from tests.paths import REPO_ROOT

# each source folder and the folder its tests mirror it in (under tests/unit and
# tests/integration); the checkout keeps producer/, shared/ and workers/ at the top level
MIRRORS = {
    "workers": "workers",
    "producer": "producer",
    "embedfleet/sinks": "sinks",
    "embedfleet/gateway": "gateway",
}
TIERS = ("unit", "integration")
# the share of those modules that must have a same-named test module
LEAST_MIRRORED = 0.8


def _counted(module: Path) -> bool:
    # generated protobuf modules have no tests of their own: their .proto's server does
    return module.name != "__init__.py" and "_pb2" not in module.name


def unmirrored(root: Path = REPO_ROOT) -> tuple[list[str], int]:
    """The modules without a same-named test module, and how many modules were counted."""
    missing: list[str] = []
    counted = 0
    for source, mirror in MIRRORS.items():
        for module in sorted((root / source).rglob("*.py")):
            if not _counted(module):
                continue
            counted += 1
            folder = module.parent.relative_to(root / source)
            test_name = f"test_{module.name}"
            if not any(
                (root / "tests" / tier / mirror / folder / test_name).is_file() for tier in TIERS
            ):
                missing.append(str(module.relative_to(root)))
    return missing, counted


def test_most_modules_have_a_same_named_test_module() -> None:
    missing, counted = unmirrored()
    assert counted > 100, "the packages were not found where this test looks"
    mirrored = (counted - len(missing)) / counted
    assert mirrored >= LEAST_MIRRORED, (
        f"{mirrored:.0%} of {counted} modules have a same-named test module (at least "
        f"{LEAST_MIRRORED:.0%}); without one: {', '.join(missing)}"
    )


def test_a_test_module_counts_only_in_its_modules_mirrored_folder(tmp_path: Path) -> None:
    for module in ("workers/model/dense.py", "workers/intake.py", "embedfleet/sinks/x_pb2.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    for test in ("tests/integration/workers/model/test_dense.py", "tests/unit/workers/test_x.py"):
        (tmp_path / test).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / test).write_text("")
    # intake's test in another folder does not count; generated modules are not counted
    (tmp_path / "tests/unit/workers/model").mkdir(parents=True)
    (tmp_path / "tests/unit/workers/model/test_intake.py").write_text("")
    assert unmirrored(tmp_path) == (["workers/intake.py"], 2)
