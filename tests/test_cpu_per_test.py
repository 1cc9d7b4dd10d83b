"""tools/cpu_per_test.py: a test's CPU counts its child processes; the summary reads the files it wrote, and
refuses what it did not write."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ROOT
from tools import cpu_per_test

pytest_plugins = ["pytester"]

CHILD_BURNS = '''
import subprocess, sys

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass"],
                   check=True)

def test_idles():
    pass
'''


def _can_account() -> bool:
    try:
        cpu_per_test.check_available()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _can_account() and not os.environ.get("CI"), reason="needs root and cgroup v1 cpuacct "
                    "(CI runs as root on this machine kind, so there it runs)")
def test_a_tests_child_processes_count_to_it(pytester: pytest.Pytester, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the inner session imports the plugin as `tools.cpu_per_test`
    pytester.makepyfile(test_inner=CHILD_BURNS)
    out = tmp_path / "cpu"
    result = pytester.runpytest_subprocess("-p", "tools.cpu_per_test", "--cpu-per-test", str(out), "-q",
                                           "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    rows = cpu_per_test.read(out)
    burn = next(v for k, v in rows.items() if k.endswith("test_burns_in_a_child"))
    idle = next(v for k, v in rows.items() if k.endswith("test_idles"))
    assert 0.4 <= burn[0] and burn[1] >= 0.4  # the child's 0.4 CPU-s, which the pytest process never spent
    assert idle[0] < 0.2
    assert "test_burns_in_a_child | " in cpu_per_test.summary(rows, 5)
    base = cpu_per_test.CPUACCT / cpu_per_test.GROUP  # a profiled outer run keeps its own groups there
    left = [d.name for d in base.iterdir() if d.is_dir()] if base.exists() else []
    assert all(Path(f"/proc/{name.split('-')[0]}").exists() for name in left), left  # none of the inner run's


def test_a_machine_without_cpuacct_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no cgroup v1 cpuacct"):
        cpu_per_test.check_available(tmp_path)


def test_the_summary_reads_every_workers_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "cpu.gw0.json").write_text(json.dumps({"tests/test_a.py::test_x": [3.0, 2.5]}))
    (tmp_path / "cpu.gw1.json").write_text(json.dumps({"tests/test_b.py::test_y": [1.0, 4.0],
                                                       "tests/test_a.py::test_z": [0.5, 0.5]}))
    assert cpu_per_test.main([str(tmp_path / "cpu"), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 tests, 4 CPU-s") and "| tests/test_a.py | 3.5 | 78% |" in out
    assert out.index("test_x") < out.index("test_y") and "test_z" not in out.split("| test |")[1]


@pytest.mark.parametrize("content", ["[]", "{\"t\": 3}", "{\"t\": [1]}", "not json", None])
def test_files_it_did_not_write_are_refused(tmp_path: Path, capsys, content: str | None) -> None:
    target = tmp_path / "cpu.gw0.json"
    if content is None:
        target.mkdir()
    else:
        target.write_text(content)
    assert cpu_per_test.main([str(tmp_path / "cpu")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpu_per_test: ") and "Traceback" not in err


def test_no_files_is_refused_with_the_option_to_use(tmp_path: Path, capsys) -> None:
    assert cpu_per_test.main([str(tmp_path / "nothing")]) == 2
    assert "--cpu-per-test" in capsys.readouterr().err
