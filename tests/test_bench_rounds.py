"""benchmarks/rounds.py: the alternation and the median every benchmark's summary line is read from."""
from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from rounds import paired_median, rotated, rounds_note, timed_rounds  # noqa: E402


def test_rotated_gives_every_way_every_position() -> None:
    orders = [rotated("ABC", r) for r in range(3)]
    assert orders == [list("ABC"), list("BCA"), list("CAB")]
    for i in range(3):  # no way always first, or always last
        assert {order[i] for order in orders} == set("ABC")
    assert [rotated("AB", r) for r in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert rotated([], 5) == []


def test_paired_median_is_the_median_of_per_round_ratios() -> None:
    # round 3 caught b in a lucky spell (0.5): its minimum would make the ratio 2.2, the medians taken apart
    # 1.5; each round's own ratio is 1.1, 1.1 and 3.0, so the paired figure is 1.1
    a = [1.1, 5.5, 1.5]
    b = [1.0, 5.0, 0.5]
    assert paired_median(a, b) == pytest.approx(1.1)
    assert min(a) / min(b) == pytest.approx(2.2) and sorted(a)[1] / sorted(b)[1] == pytest.approx(1.5)
    assert paired_median([3.0, 1.0], [1.0, 1.0]) == pytest.approx(2.0)  # an even count: the mean of the middle two


@pytest.mark.parametrize("a, b", [([1.0], [1.0, 2.0]), ([], [])])
def test_paired_median_refuses_unpaired_rounds(a: list[float], b: list[float]) -> None:
    with pytest.raises(ValueError, match="paired rounds"):
        paired_median(a, b)


def test_timed_rounds_alternates_and_skips_the_warmup() -> None:
    calls: list[str] = []
    ticks = iter(range(1000))

    def way(name: str):
        return lambda: calls.append(name)

    times = timed_rounds({"x": way("x"), "y": way("y")}, rounds=3, warmup=1, clock=lambda: float(next(ticks)))
    assert calls == ["x", "y", "y", "x", "x", "y", "y", "x"]  # round 0 (warm-up), then 3 timed, turning
    assert {k: len(v) for k, v in times.items()} == {"x": 3, "y": 3}
    assert all(t == 1.0 for v in times.values() for t in v)  # one clock tick between start and end of a call


def test_rounds_note_says_how_many() -> None:
    assert rounds_note(5) == "median of 5 alternated rounds"
    assert rounds_note(1) == "median of 1 alternated round"


def _script(name: str):
    """A benchmark script as a module (scripts are not package members)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_compress_speed_up_pairs_the_rounds() -> None:
    """Round 2 ran the uncompressed mode in a slow spell (4.0 s): its own ratio that round is 4x like round 3's,
    so the speed-up is 4.00x; the medians taken apart (1.0 / 0.5) would say 2x."""
    bench = _script("bench_compress")
    base = bench.Row("pipeline", "none", 1.0, step_s=1.0, rounds_s=[1.0, 4.0, 1.0])
    int8 = bench.Row("pipeline", "int8", 0.3, step_s=0.5, rounds_s=[0.5, 1.0, 0.25])
    assert bench.speed_up(base, int8) == pytest.approx(4.0)
    assert base.step_s / int8.step_s == pytest.approx(2.0)  # the premise: the old rule reads otherwise
    assert bench.summary_line([base, int8], 3) == "speed-up a step: pipeline int8 4.00x (median of 3 alternated rounds)"
    assert "none measured" in bench.summary_line([int8], 1)  # --smoke runs no uncompressed mode
