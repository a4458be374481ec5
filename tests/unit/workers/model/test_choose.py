"""workers/model/choose.py's pure parts: the paths a CPU class may choose, the log fields of
timed paths, and the timing helpers (one untimed call first, then the best of each)."""

from __future__ import annotations

from embedfleet.workers.cpus import CpuClass
from embedfleet.workers.model.choose import best_of, best_of_interleaved, cpu_paths, milliseconds


def test_a_cpu_without_int8_or_bf16_instructions_has_float32_alone() -> None:
    assert cpu_paths(CpuClass(frozenset({"sse4_2"}), "DEFAULT"), compiler=True) == ["float32"]


def test_an_amx_cpu_with_a_compiler_may_choose_every_path() -> None:
    amx = CpuClass(frozenset({"avx2", "avx512f", "amx_int8", "amx_bf16"}), "AVX512")
    assert cpu_paths(amx, compiler=True) == ["float32", "bfloat16", "int8-dynamic", "int8-w8a8"]
    assert "int8-w8a8" not in cpu_paths(amx, compiler=False), "W8A8 needs its kernels compiled"


def test_timed_paths_become_log_fields_in_milliseconds() -> None:
    fields = milliseconds({"bfloat16 frozen": 0.01234, "int8-w8a8": 0.5})
    assert fields == {"bfloat16_frozen_ms": 12.3, "int8_w8a8_ms": 500.0}


def test_best_of_times_every_call_after_an_untimed_one() -> None:
    calls: list[str] = []
    assert best_of(lambda: calls.append("run"), repeat=3) >= 0.0
    assert len(calls) == 4


def test_interleaved_runs_take_turns_after_one_warm_up_each() -> None:
    calls: list[str] = []
    best = best_of_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert set(best) == {"a", "b"} and all(0.0 <= value < 1.0 for value in best.values())
