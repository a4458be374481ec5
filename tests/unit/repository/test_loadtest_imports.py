"""The tests do not lean on the benchmarks: a test module imports ``loadtest`` only where it
tests a benchmark or a repository tool, or where it is listed below with the reason.

A helper both need has one owner outside ``loadtest/`` (``isolated_settings`` lives in
``embedfleet.server``, beside the Redis server both start); a helper only tests need lives under
``tests/``. ``loadtest`` imports ``tests`` only where listed (BENCHMARKS_ON_TESTS).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"
# the benchmarks' own tests, and the tests of plots and corpus
EXEMPT_FOLDERS = (TESTS / "unit" / "loadtest", TESTS / "unit" / "repository")

# test module (from the repository root) -> {loadtest module it imports: why}
ALLOWED: dict[str, dict[str, str]] = {
    "tests/end_to_end/test_host_pipeline.py": {
        "loadtest.host_pipeline": "tests the host-pipeline benchmark itself",
    },
    "tests/end_to_end/test_cluster.py": {
        "loadtest.local_cluster": "LocalCluster, the 3+3 Redis Cluster loadtest.cluster runs on "
        "too (cluster tier, not make test)",
    },
    "tests/end_to_end/test_cluster_confirm.py": {
        "loadtest.local_cluster": "LocalCluster, as test_cluster (cluster tier)",
    },
    "tests/integration/producer/test_backlog_limit.py": {
        "loadtest.local_cluster": "LocalCluster, as test_cluster (its one cluster-tier test)",
    },
    "tests/end_to_end/test_replicas.py": {
        "loadtest.replicas": "the replicas benchmark's launch (free ports, /readyz wait), run as "
        "the benchmark runs it (slow tier)",
    },
    "tests/end_to_end/test_reingest.py": {
        "loadtest.reingest": "the benchmark's words, so the test embeds the benchmark's "
        "vocabulary in other sentences (slow tier)",
    },
    "tests/integration/workers/test_packing.py": {
        "loadtest.corpus": "the benchmark corpus the packing is measured on",
        "loadtest.packed_rows": "the packed-rows reference the worker's packing is checked against",
    },
    "tests/integration/workers/test_gpu_check.py": {
        "loadtest.bench": "tests the GPU check script (useful_flops)",
        "loadtest.gpu_check": "tests the GPU check script itself",
        "loadtest.gpu_steps": "tests the GPU check script's steps",
    },
    "tests/integration/workers/test_gpu_carry.py": {
        "loadtest.gpu_carry": "tests the GPU carry script itself",
    },
    "tests/unit/workers/test_batcher.py": {
        "loadtest.host_pipeline": "masked_window_plan, the benchmark's reference plan that "
        "plan_batches must agree with",
    },
    "tests/unit/workers/test_cost_model.py": {
        "loadtest.latency": "tests the latency benchmark's paths name real settings",
    },
    "tests/unit/workers/test_cpus.py": {
        "loadtest.linear_kernels": "tests the linear-kernel benchmark runs as documented",
    },
}

# benchmark -> why it imports tests (the other way round)
BENCHMARKS_ON_TESTS = {
    "loadtest/gpu_steps.py": "tests.model_zoo's BERT-shaped and tests.image_models' CLIP "
    "ViT-L/14-shaped models for the GPU check and its rehearsal",
    "loadtest/one_pass.py": "tests.model_zoo's BGE-M3-shaped model and corpus lines",
    "loadtest/image_bench.py": "tests.image_models' CLIP ViT-B/32-shaped model (issue 56)",
    "loadtest/latency.py": "tests.image_models' CLIP ViT-B/32-shaped model for --images",
    "loadtest/worker_start.py": "tests.forks, whose forked worker start it times against a "
    "fresh one",
}


def _loadtest_imports(path: Path) -> set[str]:
    """The ``loadtest`` modules ``path`` imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from loadtest import corpus` imports loadtest.corpus
            base = node.module
            names = [f"{base}.{a.name}" if base == "loadtest" else base for a in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] == "loadtest"}
    return found


def _test_modules() -> dict[str, set[str]]:
    """Each test-side module (outside the exempt folders) -> the loadtest modules it imports."""
    imports = {}
    for path in sorted(TESTS.rglob("*.py")):
        if any(path.is_relative_to(folder) for folder in EXEMPT_FOLDERS):
            continue
        if found := _loadtest_imports(path):
            imports[str(path.relative_to(REPO_ROOT))] = found
    return imports


def test_no_test_imports_loadtest_but_the_listed_ones() -> None:
    unlisted = {
        module: sorted(found - ALLOWED.get(module, {}).keys())
        for module, found in _test_modules().items()
        if found - ALLOWED.get(module, {}).keys()
    }
    assert not unlisted, (
        f"tests import loadtest: {unlisted}; a helper only tests use belongs under tests/, "
        "one the benchmarks use too in the product (as embedfleet.server.isolated_settings)"
    )


def test_the_allowed_list_holds_no_stale_entry() -> None:
    """An entry whose import is gone (moved, or its module renamed) is taken off the list, so
    the list stays the true set of exceptions."""
    imports = _test_modules()
    stale = {
        module: sorted(allowed.keys() - imports.get(module, set()))
        for module, allowed in ALLOWED.items()
        if allowed.keys() - imports.get(module, set())
    }
    assert not stale, f"listed imports no test makes any more: {stale}"


def test_the_benchmarks_import_the_tests_only_where_listed() -> None:
    importers = []
    for path in sorted((REPO_ROOT / "loadtest").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            if any(name.split(".")[0] == "tests" for name in names):
                importers.append(str(path.relative_to(REPO_ROOT)))
    assert sorted(set(importers)) == sorted(BENCHMARKS_ON_TESTS)


def test_the_finder_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The check reads lazy imports too (test_cpus imports its benchmark inside the test)."""
    module = tmp_path / "test_x.py"
    module.write_text(
        "import os\nfrom loadtest import corpus\n"
        "def f():\n    from loadtest.common import cpu_name\n    import loadtest.bench\n"
    )
    assert _loadtest_imports(module) == {"loadtest.corpus", "loadtest.common", "loadtest.bench"}
