"""Check that a change of structure did not change training: record runs with one checkout, compare with another.

    python tools/same_training.py record DIR [--vgraph PATH]   # train, train+resume, a 2x1 launch with replicas
    python tools/same_training.py compare DIR_A DIR_B          # exit 0: every weight, optimizer tensor, state and
                                                                 # metric equal bitwise (timings excepted)

A refactoring ("behaviour unchanged") is claimed with this, not with equal losses: each scenario's final
checkpoint is compared tensor by tensor, byte for byte (dtype, shape and bytes: -0.0 vs 0.0 or one ulp is a
difference), its state.json key by key, and metrics.jsonl row by row without the wall-clock figures; each
difference is named by where it is (`extra.run.seed: A 7, B 8`).  `record` runs the
`vgraph` executable given (default: the one next to this Python), so the same script records the checkout
before and after a change, each with its own .venv.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NET = ROOT / "tests" / "fixtures" / "tiny_2l.yml"
COMMON = ["--batch", "4", "--lr", "3e-3", "--seed", "7", "--val-every", "3", "--val-batches", "2",
          "--checkpoint-every", "3", "--deterministic", "--threads", "1", "--corpus-bytes", "200000", "--quiet",
          "--no-tensorboard"]
FLEET = """name: two
pnodes:
  - {id: a, memory: 8GiB, flops: 100G, bandwidth: 1Gbit/s, accelerator: cpu}
  - {id: b, memory: 8GiB, flops: 100G, bandwidth: 1Gbit/s, accelerator: cpu}
"""
TIMINGS = {"time", "elapsed_s", "tokens_per_s", "step_s", "step_time_s", "idle_s", "peak_memory_bytes", "wall_s",
           "tensor_peak_bytes", "peak_rss_bytes",  # measurements, not training
           "seconds", "rss_bytes"}
# Nothing is left out: a launch's workers seed the global generators from the run's seed like `vgraph train`,
# so even the RNG state a checkpoint records is the same in every recording (before, rank 0's differed).
UNRECORDED: dict[str, tuple[str, ...]] = {}


def record(out: Path, vgraph: str) -> None:
    out.mkdir(parents=True, exist_ok=False)
    fleet = out / "two.yml"
    fleet.write_text(FLEET)
    runs = {
        "train": [["train", str(NET), "--steps", "6", "--out", str(out / "train"), *COMMON]],
        "resume": [["train", str(NET), "--steps", "3", "--out", str(out / "resume"), *COMMON],
                   ["train", str(NET), "--steps", "6", "--out", str(out / "resume"), "--resume", *COMMON]],
        "launch": [["launch", str(NET), "--fleet", str(fleet), "--replicas", "2", "--steps", "6",
                    "--out", str(out / "launch"), *COMMON]],
    }
    for name, commands in runs.items():
        for cmd in commands:
            done = subprocess.run([vgraph, *cmd], capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                sys.exit(f"{name}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        print(f"recorded {name}")


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path)) if path.is_file() else {}


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMINGS}
    return value


def _rows(path: Path) -> list[dict]:
    return [_untimed(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _plain(value):
    """JSON as the checkpoint's encoder wrote it, with its objects ({"__dict__": [[key, value], ...]}) read back as
    mappings, so that a difference is named by its keys, not by positions in a list of pairs."""
    if isinstance(value, dict):
        pairs = value.get("__dict__") if len(value) == 1 else None
        if isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            return {k: _plain(v) for k, v in pairs}
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def where_differs(a, b, path: str = "", most: int = 5) -> list[str]:
    """The first `most` places where two JSON values differ, as `key.key[index]` with what each side holds
    there (a reader acts on "extra.run.data_content only in B", not on "state.json differs")."""
    out: list[str] = []

    def walk(x, y, at: str) -> None:
        if len(out) >= most:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                here = f"{at}.{k}" if at else str(k)
                if k not in y:
                    out.append(f"{here} only in A")
                elif k not in x:
                    out.append(f"{here} only in B")
                else:
                    walk(x[k], y[k], here)
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                out.append(f"{at}: A has {len(x)} items, B {len(y)}")
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{at}[{i}]")
        elif x != y or type(x) is not type(y):
            out.append(f"{at or '(the whole value)'}: A {json.dumps(x)[:60]}, B {json.dumps(y)[:60]}")

    walk(_plain(a), _plain(b), path)
    return out


def bitwise_equal(a, b) -> bool:
    """The same dtype, shape and bytes: `torch.equal` compares values, so it takes -0.0 for 0.0 and a NaN for
    different from the same NaN; a refactoring's claim is about the bytes."""
    import torch

    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def compare(a: Path, b: Path) -> list[str]:
    diffs = []
    for name in ("train", "resume", "launch"):
        ra, rb = a / name, b / name
        ckpt = (ra / "latest").read_text().strip()
        if ckpt != (rb / "latest").read_text().strip():
            diffs.append(f"{name}: latest checkpoints differ")
            continue
        for f in sorted(p.name for p in (ra / ckpt).iterdir()):
            fa, fb = ra / ckpt / f, rb / ckpt / f
            if f.endswith(".safetensors"):
                ta, tb = _tensors(fa), _tensors(fb)
                if ta.keys() != tb.keys():
                    diffs.append(f"{name}/{f}: tensor names differ")
                diffs += [f"{name}/{f}: {k} differs" for k in sorted(ta.keys() & tb.keys())
                          if not k.startswith(UNRECORDED.get(name, ())) and not bitwise_equal(ta[k], tb[k])]
            elif f.endswith(".json"):
                ja, jb = (json.loads(p.read_text()) for p in (fa, fb))
                for key in UNRECORDED.get(name, ()):
                    for doc in (ja, jb):
                        doc.pop(key, None) if isinstance(doc, dict) else None
                diffs += [f"{name}/{f}: {w}" for w in where_differs(ja, jb)]
        diffs += [f"{name}/metrics.jsonl: {w}" for w in where_differs(_rows(ra / "metrics.jsonl"),
                                                                      _rows(rb / "metrics.jsonl"), "rows")]
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("dir", type=Path)
    r.add_argument("--vgraph", default=str(Path(sys.executable).with_name("vgraph")))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.dir, args.vgraph)
        return 0
    diffs = compare(args.a, args.b)
    for d in diffs:
        print(d)
    print("identical: weights, optimizer state, checkpoint state and metrics" if not diffs
          else f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
