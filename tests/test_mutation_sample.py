"""tools/mutation.py's `--sample`: a seeded uniform draw of a target's mutants that does not depend on the
order cosmic-ray lists them in (its job ids are random per session), so a sampled run can be repeated."""
from __future__ import annotations

import random

import pytest

from tools.mutation import Sample, draw, main


def test_the_same_seed_draws_the_same_mutants_whatever_their_order() -> None:
    items = [(line, op) for line in range(1, 200) for op in ("Add", "Sub")]
    shuffled = items[:]
    random.Random(7).shuffle(shuffled)
    first = draw(items, Sample(30, seed=3), key=lambda i: i)
    assert first == draw(shuffled, Sample(30, seed=3), key=lambda i: i)
    assert len(first) == len(set(first)) == 30 and set(first) <= set(items)
    assert first == sorted(first)  # reported in source order
    assert draw(items, Sample(30, seed=4), key=lambda i: i) != first  # another seed, another sample


def test_a_sample_larger_than_the_target_runs_every_mutant() -> None:
    items = [3, 1, 2]
    assert draw(items, Sample(3), key=lambda i: i) == [1, 2, 3]
    assert draw(items, Sample(10), key=lambda i: i) == [1, 2, 3]


def test_the_draw_is_uniform() -> None:
    """Every mutant equally likely: over many seeds each of 20 items is drawn about 5 / 20 of the time."""
    counts = [0] * 20
    for seed in range(4000):
        for i in draw(list(range(20)), Sample(5, seed), key=lambda i: i):
            counts[i] += 1
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in counts), counts


@pytest.mark.parametrize("argv", [["--sample", "0", "stepcost"], ["--sample", "-3", "stepcost"],
                                  ["--sample", "abc", "stepcost"], ["--sample", "nan", "stepcost"],
                                  ["--sample", "1e9x", "stepcost"], ["--sample", "5", "--seed", "x", "stepcost"],
                                  ["--sample", "5", "no-such-target"]])
def test_bad_sample_options_are_refused_before_anything_runs(argv: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err
