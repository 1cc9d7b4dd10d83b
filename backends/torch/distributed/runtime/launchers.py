"""Where a worker stands: its rank, the world, and the rendezvous, under each of the three ways to start a run.

    place = worker_place(os.environ)     # WorkerPlace(launcher="slurm", rank=3, world=8, local_rank=1, ...)

A worker (worker.py) is one program started three ways (docs/distributed.md):

* by `vgraph launch`: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  and the run's secret VGRAPH_LAUNCH_TOKEN in its environment (launch.py);
* by `torchrun` (TORCHELASTIC_RUN_ID set): the same variables, from
  torchrun's own c10d rendezvous;
* by `srun` (SLURM_PROCID set, RANK not): SLURM_PROCID is the rank,
  SLURM_NTASKS the world, SLURM_LOCALID the local rank (the GPU on its
  machine), the first host of SLURM_JOB_NODELIST the master (MASTER_ADDR
  overrides it) and MASTER_PORT or, without it, 29500 + SLURM_JOB_ID mod 2000,
  so two jobs sharing a first node rarely collide.

SLURM writes node lists compressed (`node[01-04,07],gpu-[1-2]-ib`); there is
no `scontrol` on a compute node's minimal image to expand them, so
`expand_nodelist` does, following Slurm's hostlist syntax: comma-separated
names, each with any number of bracketed lists of numbers and ranges (their
zero padding kept; several brackets multiply out).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from vgraph.base.diagnostics import VGraphError, quote

__all__ = ["WorkerPlace", "worker_place", "expand_nodelist", "LauncherError", "SLURM_BASE_PORT"]

SLURM_BASE_PORT = 29500
MAX_HOSTS = 100_000  # a node list expanding to more is not a cluster's


class LauncherError(VGraphError):
    """The environment does not say where this worker stands."""


@dataclass(frozen=True)
class WorkerPlace:
    launcher: str  # "vgraph" | "torchrun" | "slurm"
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    restart: int = 0  # torchrun's restart count (0 elsewhere): a restarted worker set resumes by itself


def _int(env: Mapping[str, str], name: str, low: int, high: int) -> int:
    text = env.get(name)
    if text is None:
        raise LauncherError(f"{name} is not set: start workers with vgraph launch, torchrun or srun "
                            f"(docs/distributed.md)")
    try:
        value = int(text.strip())
    except ValueError:
        raise LauncherError(f"{name}={quote(text, 40)} is not an integer") from None
    if not low <= value <= high:
        raise LauncherError(f"{name}={value} is outside {low}..{high}")
    return value


def worker_place(env: Mapping[str, str]) -> WorkerPlace:
    """This worker's place from its environment (see the module docstring)."""
    if "SLURM_PROCID" in env and "RANK" not in env:
        world = _int(env, "SLURM_NTASKS", 1, 2**31)
        rank = _int(env, "SLURM_PROCID", 0, world - 1)
        local = _int(env, "SLURM_LOCALID", 0, 2**31)
        addr = env.get("MASTER_ADDR") or _first_host(env)
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT", 1, 65535)
        else:
            port = SLURM_BASE_PORT + _int(env, "SLURM_JOB_ID", 0, 2**63) % 2000
        return WorkerPlace("slurm", rank, world, local, addr, port)
    world = _int(env, "WORLD_SIZE", 1, 2**31)
    rank = _int(env, "RANK", 0, world - 1)
    local = _int(env, "LOCAL_RANK", 0, 2**31) if "LOCAL_RANK" in env else rank
    port = _int(env, "MASTER_PORT", 1, 65535)
    torchrun = bool(env.get("TORCHELASTIC_RUN_ID"))
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", 0, 2**31) if torchrun and "TORCHELASTIC_RESTART_COUNT" in env \
        else 0
    return WorkerPlace("torchrun" if torchrun else "vgraph", rank, world, local,
                       env.get("MASTER_ADDR") or "127.0.0.1", port, restart)


def _first_host(env: Mapping[str, str]) -> str:
    text = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not text:
        raise LauncherError("SLURM_JOB_NODELIST is not set and neither is MASTER_ADDR: srun sets the first, "
                            "or export MASTER_ADDR=<the first node> in the job script")
    return expand_nodelist(text)[0]


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: `node[01-03,07],gpu1` ->
    node01, node02, node03, node07, gpu1.  A LauncherError names what is wrong with a malformed one."""
    hosts: list[str] = []
    for item in _split_top_level(text):
        hosts.extend(_expand_item(item, text))
        if len(hosts) > MAX_HOSTS:
            raise LauncherError(f"node list {quote(text, 60)} names more than {MAX_HOSTS} hosts")
    if not hosts:
        raise LauncherError(f"node list {quote(text, 60)} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """The comma-separated names of a host list, commas inside brackets kept."""
    items, depth, current = [], 0, []
    for c in text.strip():
        if c == "[":
            depth += 1
            if depth > 1:
                raise LauncherError(f"node list {quote(text, 60)}: nested brackets")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise LauncherError(f"node list {quote(text, 60)}: ']' without '['")
        if c == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(c)
    if depth:
        raise LauncherError(f"node list {quote(text, 60)}: '[' without ']'")
    items.append("".join(current))
    if any(not item for item in items):
        raise LauncherError(f"node list {quote(text, 60)}: an empty name")
    return items


def _expand_item(item: str, text: str) -> list[str]:
    """One name with brackets (`rack[1-2]-n[01,03]`): the product of its bracketed lists, in order."""
    names = [""]
    for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        literal, bracket = m.group(1), m.group(2)
        if literal and not _NAME.fullmatch(literal):
            raise LauncherError(f"node list {quote(text, 60)}: {quote(literal, 40)} is not a host name")
        numbers = _expand_bracket(bracket, text) if bracket is not None else [""]
        names = [n + literal + x for n in names for x in numbers]
        if len(names) > MAX_HOSTS:
            raise LauncherError(f"node list {quote(text, 60)} names more than {MAX_HOSTS} hosts")
    return names


def _expand_bracket(body: str, text: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise LauncherError(f"node list {quote(text, 60)}: [{quote(body, 40)}] is not a list of numbers and "
                                f"ranges like 01-04,07")
        first, last = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(first), int(last)
        if hi < lo:
            raise LauncherError(f"node list {quote(text, 60)}: range {first}-{last} runs backwards")
        if hi - lo >= MAX_HOSTS:
            raise LauncherError(f"node list {quote(text, 60)} names more than {MAX_HOSTS} hosts")
        width = len(first)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out
