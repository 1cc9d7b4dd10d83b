"""The launcher of `vgraph launch` imports no torch until it handles tensors (issue 36).

Why: at 0.35 of a core, a joining machine's `vgraph launch --join` imported torch twice before it was admitted
(its launcher, 3-4 CPU-s here, and the workers' forkserver); only the workers (and the launcher's rescue,
checkpoint and device code) need it.  Each check runs in a fresh interpreter (not the zygote: it has torch), and
each fails on a launcher that imports torch at the top of a module it loads (9566de3 did, through
backends/torch/__init__.py, training/config.py's batches, emission.py, rescue.py and checkpoint.py)."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

#: The launcher's entry and the modules a joining machine's launcher runs before and while it follows jobs.
JOIN_PATH = ["vgraph.backends.torch.distributed.launcher." + m
             for m in ("launch", "elastic", "membership", "supervisor", "shard_transfer", "attempts", "succession",
                       "mirror", "boundaries", "failures", "inputs", "emission", "placing")]
JOIN_PATH += ["vgraph.backends.torch.distributed.job", "vgraph.backends.torch.distributed.rendezvous",
              "vgraph.backends.torch.training.checkpoint", "vgraph.backends.torch.training.rescue",
              "vgraph.backends.torch.distributed.runtime.comm_choice"]

TORCH_LOADED = "sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'safetensors.torch')))"


def fresh(code: str) -> list[str]:
    """`code` in a new interpreter from the checkout; its stdout's lines (it must succeed)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_launchers_modules_import_without_torch() -> None:
    out = fresh(f"import importlib, sys\nmods = {JOIN_PATH!r}\nfor m in mods:\n    importlib.import_module(m)\n"
                f"print('MISSING', [m for m in mods if m not in sys.modules])\nprint('TORCH', {TORCH_LOADED})")
    assert out[-2:] == ["MISSING []", "TORCH []"], out[-2:]


def test_launch_help_imports_no_torch() -> None:
    out = fresh("import contextlib, io, sys\nfrom vgraph.cli.main import main\nbuf = io.StringIO()\n"
                "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
                "    main(['launch', '--help'])\n"
                f"print('JOIN' if '--join HOST:PORT' in buf.getvalue() else buf.getvalue())\nprint('TORCH', {TORCH_LOADED})")
    assert out[-2:] == ["JOIN", "TORCH []"], out[-2:]  # the help was printed (its --join option), without torch


def test_the_backends_names_resolve_on_first_use_and_others_are_refused() -> None:
    """PEP 562 in backends/torch/__init__.py and distributed/__init__.py: the stable names (docs/plugins.md)
    import their module when first used; a name that is neither a public name nor a submodule is an
    AttributeError (an ImportError for `from ... import`), never a silent None."""
    out = fresh(
        "import sys\nimport vgraph.backends.torch as tb\nimport vgraph.backends.torch.distributed as td\n"
        "print('BEFORE', 'torch' in sys.modules)\n"
        "from vgraph.backends.torch import compile_network, register_lowering, TrainConfig\n"
        "from vgraph.backends.torch.training.train import train\n"
        "print('SAME', tb.train is train and compile_network.__module__, TrainConfig.__module__)\n"
        "print('DIST', td.keyed_dropout.__module__, td.make_plan.__module__, td.launch.__module__)\n"
        "from vgraph.backends.torch import cli\nprint('SUB', cli.__name__)\n"
        "print('DIR', all(n in dir(tb) for n in tb.__all__), all(n in dir(td) for n in td.__all__))\n"
        "try:\n    tb.no_such_name\nexcept AttributeError as e:\n    print('REFUSED', e)\n"
        "try:\n    from vgraph.backends.torch.distributed import no_such_name\nexcept ImportError as e:\n"
        "    print('REFUSED', type(e).__name__)\n")
    assert out == [
        "BEFORE False",
        "SAME vgraph.backends.torch.lowering.lower vgraph.backends.torch.training.config",
        "DIST vgraph.backends.torch.lowering.dropout vgraph.run.step_plan "
        "vgraph.backends.torch.distributed.launcher.launch",
        "SUB vgraph.backends.torch.cli",
        "DIR True True",
        "REFUSED module 'vgraph.backends.torch' has no attribute 'no_such_name'",
        "REFUSED ImportError",
    ], out
