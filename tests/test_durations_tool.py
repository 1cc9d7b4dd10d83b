"""tools/durations.py: the order file is read from a suite log; bad logs are refused and nothing is overwritten."""
from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from tools import durations

LOG = """\
============================= slowest durations ==============================
50.05s call     tests/test_benchmarks_smoke.py::test_benchmark_runs_on_its_smallest_setting[bench_testbed.py]
10.50s setup    tests/test_plugin_onnx_parity.py::test_checkpoints_fit_across_a_plugins_preserving_fusion@tests/x.py
18.51s call     tests/test_plugin_onnx_parity.py::test_checkpoints_fit_across_a_plugins_preserving_fusion@tests/x.py
0.70s call     tests/test_rules.py::test_cli_reports[broken-rule-rule 'broken' failed: KeyError: 'k']
0.20s call     tests/test_fast.py::test_quick
(2 durations < 0.005s hidden.  Use -vv to show these durations.)
3368 passed, 40 skipped in 452.89s (0:07:32)
"""


def test_phases_are_summed_group_suffixes_dropped_and_fast_tests_left_out(tmp_path: Path) -> None:
    seconds = durations.parse(LOG)
    assert seconds["tests/test_plugin_onnx_parity.py::test_checkpoints_fit_across_a_plugins_preserving_fusion"] == \
        18.51 + 10.50
    assert seconds["tests/test_rules.py::test_cli_reports[broken-rule-rule 'broken' failed: KeyError: 'k']"] == 0.70
    out = tmp_path / "d.json"
    assert durations.write(seconds, out) == 3  # 0.20 s is below MIN_SECONDS
    kept = json.loads(out.read_text())
    assert list(kept) == sorted(kept, key=lambda k: -kept[k])  # longest first
    assert "tests/test_fast.py::test_quick" not in kept


def test_bad_logs_are_refused_and_the_file_is_kept(tmp_path: Path, capsys) -> None:
    out = tmp_path / "d.json"
    out.write_text("{}\n")
    empty = tmp_path / "empty.log"
    empty.write_text("")
    for log in (tmp_path / "missing.log", tmp_path, empty):
        assert durations.main([str(log), "-o", str(out)]) == 2
        assert "durations:" in capsys.readouterr().err
    log = tmp_path / "suite.log"
    log.write_text(LOG)
    assert durations.main([str(log), "-o", str(log)]) == 2  # never over its input
    assert durations.main([str(log), "-o", str(tmp_path)]) == 2  # a directory
    assert durations.main([str(log), "-o", str(tmp_path / "no" / "d.json")]) == 2
    assert log.read_text() == LOG and out.read_text() == "{}\n"
    assert durations.main([str(log), "-o", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".d.json")]  # no temporary left behind


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=400))
def test_any_text_parses_to_nonnegative_seconds(text: str) -> None:
    assert all(v >= 0 for v in durations.parse(text).values())


def test_the_suite_reads_the_committed_order() -> None:
    """The committed file parses, and names tests by the ids pytest gives (a test id never starts elsewhere)."""
    kept = json.loads(durations.OUT.read_text(encoding="utf-8"))
    assert kept and all(k.startswith("tests/test_") and "::" in k and v >= durations.MIN_SECONDS
                        for k, v in kept.items())
