"""`vgraph probe`: measure this machine for a network and write its fleet entry.

    vgraph probe NETWORK.yml --id ID [-o PNODE.yml | --append FLEET.yml] [--peer HOST:PORT | --bandwidth BW]
                 [--device D] [--threads N] [--batch B] [--passes SPEC] [--seconds S] [--no-precisions]
    vgraph probe --serve [--listen ADDR:PORT] [--once]       # the other end of --peer
    vgraph probe --collectives --nnodes N --node-rank I --master-addr HOST [--master-port P] [--rounds K]
                 [--append FLEET.yml]                        # on every host at once: probe_collectives.py

What is measured, and why that way: probe.py.  The entry is a fleet PNode (vgraph/cost/fleet.py: memory,
flops, bandwidth, accelerator, `efficiency` per op kind, vgraph/cost/op_kinds.py, and `update`, a step's
work beyond the program, vgraph/cost/update.py); `-o` writes a fleet
of that one PNode, `--append` adds it to a fleet file (comments, regions and layout kept; a new file is
created), neither given prints it.  Outputs are atomic and never an input.  The link is measured against a
peer running `vgraph probe --serve` (a TCP stream for --seconds, counted by the receiver: what this machine
can send), or stated with --bandwidth in the fleet's units; nothing else can tell it.

The link's burst is measured too (`burst`, vgraph/cost/makespan.py): after the stream, BURST_ROUNDS short
transfers each after the link idled BURST_IDLE_S; the peer returns when each byte arrived, and the bytes that
came ahead of the transfer's own steady rate (the intercept of a line through the arrivals after the first
third) are what a token bucket on the way passed at once.  A rate limiter's bucket (tbf, a provider's
shaper) lets a message after idle cross at line speed: on the testbed tb-small's 16 KiB messages at 20
Mbit/s did, and a model charging bytes / rate for them predicted its pipelines 1.4x-1.7x slow.

The serving side only counts the bytes it is sent and answers with the count (and at most MAX_CURVE arrival
points).  It listens on 127.0.0.1 unless --listen names an address, and never on a wildcard (the one check of
every listener, distributed/rendezvous.py); both ends need the shared secret in VGRAPH_LAUNCH_TOKEN, as
`vgraph launch` across machines does: a connection first presents a digest of it on a bounded line, checked
before anything it sends is parsed, and one that does not is closed unanswered and does not count against
--once (a port scan uses up nothing).  Then it reads one bounded header line, runs one measurement at a
time, each at most MAX_SERVE_S seconds, and with --once serves one probe (its stream and the burst transfers
it announces, at most MAX_ROUNDS connections).  Whatever a client sends or does, the server answers or drops
that connection and goes on: every per-connection error is caught and logged.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from vgraph.base import options
from vgraph.base.diagnostics import VGraphError, quote
from vgraph.base.jsonio import loads
from vgraph.base.numbers import NumberError, checked_number, number_or_none
from vgraph.base.safeio import atomic_write, check_output, read_input
from vgraph.cost.fleet import MAX_FLEET_BYTES, PNode, append_pnode, fleet_text, parse_bandwidth, pnode_flow

DEFAULT_PORT = 29400
MAX_BATCH, MAX_THREADS, MAX_SECONDS = 4096, 1024, 600.0
MAX_SERVE_S = 120.0
BURST_ROUNDS, BURST_IDLE_S, BURST_SECONDS = 3, 0.5, 0.25  # transfers, idle before each, length at the rate
MAX_ROUNDS = 1 + BURST_ROUNDS  # connections one probe makes to a --serve --once
MAX_CURVE = 512  # arrival points a peer returns
MAX_LINK_RATE = 1e12  # bytes/s (8 Tbit/s): faster than any link a probe measures; a reply claiming more lies
CONNECT_PATIENCE_S = 10.0  # how long a refusing peer is retried (it may still be starting)
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")


def register_probe(subparsers: argparse._SubParsersAction) -> None:
    """Add `probe` to a `vgraph` subparser set (entry point of group `vgraph.commands`)."""
    from vgraph.cli.main import add_plugin_option

    p = subparsers.add_parser(
        "probe", help="measure this machine for a network: its fleet entry (FLOP/s per op kind, memory, link)",
        description="Measure this machine with the network's own operations (a large GEMM, every VNode of the "
                    "training program, the whole program, per precision) and write its fleet PNode entry.")
    p.add_argument("network", metavar="FILE", nargs="?", type=options.network_file,
                   help="network YAML or a shipped network's name (not with --serve)")
    p.add_argument("--id", help="the PNode's id (default: this machine's host name)")
    p.add_argument("-o", "--output", metavar="PNODE.yml", type=options.path, help="write a fleet of this one PNode")
    p.add_argument("--append", metavar="FLEET.yml", type=options.path, help="add the PNode to this fleet file")
    p.add_argument("--peer", metavar="HOST:PORT", help="measure the link to a `vgraph probe --serve` there")
    p.add_argument("--bandwidth", metavar="BW", help="state the link instead (fleet units: 1Gbit/s, 125MB/s)")
    p.add_argument("--seconds", type=options.positive_float, default=3.0, metavar="S",
                   help="length of the link measurement (default 3)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--threads", type=options.positive_int, metavar="N",
                   help="CPU threads, as the workers will use (default: torch's)")
    p.add_argument("--batch", type=options.positive_int, default=8, metavar="B",
                   help="the largest micro-batch the timings use (they also take 1, 2 and 4) and the batch a "
                        "step draws (default 8)")
    p.add_argument("--passes", metavar="SPEC", help="pass pipeline the network trains with (default: production)")
    p.add_argument("--no-precisions", action="store_true", help="skip the table of FLOP/s per precision")
    p.add_argument("--quick", action="store_true",
                   help="one short repetition of every timing: checks that the probe runs here (a test, a "
                        "benchmark's smoke run); its figures are noise, not a fleet entry to plan with")
    p.add_argument("--cpu-burst", action="store_true",
                   help="also time how much faster the CPU computes right after idling (a CPU quota's burst: "
                        "vgraph/cost/cpu_quota.py) and write `cpu_burst`; the step cost then prices a pipeline "
                        "stage's waits as refilling its quota.  Opt-in: checked on one CPU kind (the testbed's "
                        "0.35-core AMD hosts: pipelines from 1.05-1.29x their measured step to 0.80-0.97), and on "
                        "a busy machine a process that slept is scheduled first, which times as a burst too")
    p.add_argument("--serve", action="store_true", help="be the peer of another machine's --peer")
    p.add_argument("--listen", metavar="ADDR:PORT", default=f"127.0.0.1:{DEFAULT_PORT}",
                   help=f"with --serve: where to listen (default 127.0.0.1:{DEFAULT_PORT}: this machine only; "
                        f"give the address the peer reaches, never a wildcard)")
    p.add_argument("--once", action="store_true", help="with --serve: stop after one probe's measurements")
    p.add_argument("--collectives", action="store_true",
                   help="on every host at once: time the step's small collectives among them and write the "
                        "fleet's `collectives` table (rank 0, into --append's fleet)")
    p.add_argument("--nnodes", type=options.positive_int, metavar="N", help="with --collectives: how many hosts")
    p.add_argument("--node-rank", type=options.non_negative_int, metavar="I", help="with --collectives: this host")
    p.add_argument("--master-addr", metavar="HOST", help="with --collectives: host 0's address, as for launch")
    p.add_argument("--master-port", type=options.port, default=29500, metavar="PORT",
                   help="with --collectives: the rendezvous port on host 0 (default 29500)")
    p.add_argument("--rounds", type=options.positive_int, default=100, metavar="K",
                   help="with --collectives: timed repetitions per measurement (default 100)")
    add_plugin_option(p)
    p.set_defaults(func=run_probe)


def host_port(text: str, what: str) -> tuple[str, int]:
    """'HOST:PORT' ('[v6]:PORT' too) -> (host, port); VGraphError naming the option otherwise."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or not host.isprintable():
        raise VGraphError(f"{what}: expected HOST:PORT with a port from 1 to 65535, got {quote(str(text))}")
    return host, int(port)


def _checked(args: argparse.Namespace) -> dict:
    """Every option checked before anything is measured (a mistake costs no probe)."""
    if args.collectives:
        return _checked_collectives(args)
    if any(x is not None for x in (args.nnodes, args.node_rank, args.master_addr)):
        raise VGraphError("--nnodes, --node-rank and --master-addr go with --collectives")
    listen = host_port(args.listen, "--listen")
    if args.serve:
        if any(x is not None for x in (args.network, args.output, args.append, args.peer)) or args.quick \
                or args.cpu_burst:
            raise VGraphError("--serve takes no network, output, --peer, --quick or --cpu-burst: it is the other end "
                              "of a --peer")
        return {"listen": (listen_address(listen[0]), listen[1]), "token": probe_token()}
    if not args.network:
        raise VGraphError("vgraph probe needs a network FILE (or --serve)")
    if args.output is not None and args.append is not None:
        raise VGraphError("give either -o or --append, not both")
    pid = args.id if args.id is not None else re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:200] or "pnode"
    if not _ID.fullmatch(pid):
        raise VGraphError(f"--id {quote(pid)}: must be letters, digits, '_', '.' or '-' (at most 200), not starting "
                          f"with '.' or '-' (it names a file when a partition is exported)")
    if args.batch > MAX_BATCH or (args.threads or 1) > MAX_THREADS or args.seconds > MAX_SECONDS:
        raise VGraphError(f"--batch is at most {MAX_BATCH}, --threads {MAX_THREADS}, --seconds {MAX_SECONDS:g}")
    out = {"id": pid, "peer": host_port(args.peer, "--peer") if args.peer is not None else None}
    if args.peer is not None:
        out["token"] = probe_token()
    if (args.peer is None) == (args.bandwidth is None):
        raise VGraphError("the link can only be measured against a peer: give --peer HOST:PORT (a `vgraph probe "
                          "--serve` there) or state it with --bandwidth, e.g. --bandwidth 1Gbit/s (one of the two)")
    if args.bandwidth is not None:
        try:
            out["bandwidth"] = parse_bandwidth(args.bandwidth)
        except ValueError as exc:
            raise VGraphError(f"--bandwidth: {exc}") from None
        if not out["bandwidth"] > 0:
            raise VGraphError(f"--bandwidth must be positive, got {quote(args.bandwidth)}")
    target = args.output if args.output is not None else args.append
    if target is not None:
        what = "-o" if args.output is not None else "--append"
        check_output(target, inputs=[args.network], what=what)
        parent = Path(target).parent
        if parent.exists() and not parent.is_dir():
            raise VGraphError(f"{what} {quote(str(target))}: {quote(str(parent))} is not a directory")
        if args.append is not None and Path(args.append).exists():
            text = read_input(args.append, what="fleet file", limit=MAX_FLEET_BYTES)
            append_pnode(text, str(args.append), PNode(pid, 1, 1.0, 1.0))  # the fleet reads and takes this id
            out["fleet_text"] = text
    return out


def _checked_collectives(args: argparse.Namespace) -> dict:
    from vgraph.cost.collectives import MAX_RANKS

    from ..distributed.rendezvous import TOKEN_ENV, check_master_addr, check_token
    from .collectives import MAX_ROUNDS

    if args.serve or args.quick or args.cpu_burst or any(x is not None for x in (args.network, args.output, args.peer,
                                                                                  args.bandwidth, args.id)):
        raise VGraphError("--collectives takes no network, -o, --id, --peer, --bandwidth, --quick, --cpu-burst or "
                          "--serve: it "
                          "measures the hosts together, not this machine (--rounds sets its length)")
    if args.nnodes is None or args.node_rank is None or args.master_addr is None:
        raise VGraphError("--collectives needs --nnodes N, --node-rank I and --master-addr HOST (host 0's address), "
                          "on every host at once, as `vgraph launch` does")
    if not 2 <= args.nnodes <= MAX_RANKS or args.node_rank >= args.nnodes or args.rounds > MAX_ROUNDS:
        raise VGraphError(f"--collectives needs --nnodes from 2 to {MAX_RANKS:,}, --node-rank from 0 to --nnodes - 1 and "
                          f"--rounds of at most {MAX_ROUNDS:,} (got {args.nnodes}, {args.node_rank}, {args.rounds})")
    addr = check_master_addr(args.master_addr)
    token = check_token(os.environ.get(TOKEN_ENV), args.nnodes)
    if args.append is not None:
        check_output(args.append, inputs=[], what="--append")
    return {"env": {**os.environ, TOKEN_ENV: token, "MASTER_ADDR": addr, "MASTER_PORT": str(args.master_port)}}


def run_probe(args: argparse.Namespace) -> int:
    checked = _checked(args)
    if args.collectives:
        from .collectives import run_collectives

        run_collectives(args.node_rank, args.nnodes, args.rounds, args.append, checked["env"],
                        lambda line: print(line, file=sys.stderr, flush=True))
        return 0
    if args.serve:
        serve(*checked["listen"], once=args.once, token=checked["token"])
        return 0
    import torch

    import vgraph

    from .measure import probe, quick_timings
    from ..training.setup import device_target, prepare_graph, resolve_device

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    graph = prepare_graph(vgraph.load(args.network), passes=args.passes, target=device_target(device))
    bandwidth, burst = ((checked["bandwidth"], 0) if "bandwidth" in checked
                        else measure_link(*checked["peer"], seconds=args.seconds, token=checked["token"]))
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    with quick_timings() if args.quick else contextlib.nullcontext():
        result = probe(graph, device, args.batch, per_precision=not args.no_precisions, say=say,
                       cpu_quota=args.cpu_burst)
    if result.memory is None:
        raise VGraphError(f"the memory of {device} cannot be read here ({result.memory_source})")
    pnode = PNode(checked["id"], result.memory, result.peak, bandwidth, result.accelerator,
                  efficiency=result.efficiency, burst=burst, update=result.update, cpu_burst=result.cpu_burst)
    _report(result, pnode, graph.name, say)
    comment = (f"vgraph probe of network {graph.name!r} on {time.strftime('%Y-%m-%d %H:%M')}: {result.precision}, "
               f"peak {result.peak / 1e9:.3g} GFLOP/s (a large GEMM), link "
               f"{'measured to ' + args.peer if args.peer else 'as stated'}")
    if args.output:
        atomic_write(args.output, fleet_text(pnode.id, [pnode], comment))
    elif args.append:
        text = checked.get("fleet_text")
        atomic_write(args.append, append_pnode(text, str(args.append), pnode) if text is not None
                     else fleet_text(Path(args.append).stem, [pnode], comment))
    else:
        print(f"  - {pnode_flow(pnode)}")
    return 0


def _report(result, pnode: PNode, network: str, say) -> None:
    say(f"probe: {pnode.id}: {result.accelerator}, {pnode.memory / 2**30:.2f} GiB free ({result.memory_source}), "
        f"peak {result.peak / 1e9:.3g} GFLOP/s at {result.precision}, link {pnode.bandwidth * 8 / 1e6:.4g} Mbit/s"
        f"{f', burst {pnode.burst:,} B' if pnode.burst else ''}")
    for kind, cost in result.efficiency.kinds:
        share = f"{cost.of_peak:.3g} of peak" if cost.of_peak is not None else "no FLOPs"
        say(f"probe:   {kind:<11} {share:>14}, {cost.overhead * 1e6:8.1f} us per VNode and micro-batch")
    if result.update is not None:
        say(f"probe:   a step's batch draw and optimizer update: {result.update.fixed * 1e3:.3g} ms + "
            f"{result.update.per_param * 1e9:.3g} ns a parameter")
    if result.cpu_burst is not None:
        say(f"probe:   right after idling the CPU computes {result.cpu_burst.speedup:.3g}x as fast for "
            f"{result.cpu_burst.bucket * 1e3:.3g} ms (a CPU quota's burst)")
    for precision, rates in result.rates.items():
        say(f"probe:   {network} at {precision}: " + ", ".join(f"{k} {v / 1e9:.3g} GFLOP/s" for k, v in rates.items()))


# -- the secret and the address ---------------------------------------------------------------------

AUTH_PREFIX = b"vgraph-probe "  # a connection's first line: this, then the digest of the secret
MAX_AUTH_LINE = len(AUTH_PREFIX) + 64 + 1


def probe_token(env: dict | None = None) -> str:
    """The shared secret of `--serve` and `--peer` (VGRAPH_LAUNCH_TOKEN, the rules of `vgraph launch`)."""
    from ..distributed.rendezvous import TOKEN_ENV, check_token

    token = (os.environ if env is None else env).get(TOKEN_ENV)
    if not token:
        raise VGraphError(f"probe --serve and --peer need a shared secret: set {TOKEN_ENV} to the same value on "
                          f"both machines (e.g. export {TOKEN_ENV}=$(openssl rand -hex 16)); the server answers "
                          f"no one without it")
    return check_token(token, 2)


def listen_address(addr: str) -> str:
    """--listen's address through the one check of every listener (never a wildcard)."""
    from ..distributed.rendezvous import check_listen_addr

    return check_listen_addr(addr, "--listen")


def auth_line(token: str) -> bytes:
    """What a client sends first: a digest of the secret (the secret itself never crosses the wire)."""
    return AUTH_PREFIX + hashlib.sha256(("vgraph-probe:" + token).encode()).hexdigest().encode() + b"\n"


# -- the link ---------------------------------------------------------------------------------------

def measure_link(host: str, port: int, seconds: float, token: str | None = None) -> tuple[float, int]:
    """(bytes/s this machine sends to a `vgraph probe --serve` at host:port, as the receiver counted them;
    the bytes its link passes at once after idling: `burst`).  `token`: the shared secret (default: the
    environment's, `probe_token`)."""
    auth = auth_line(token if token is not None else probe_token())
    payload = b"\0" * (1 << 20)
    reply = _transfer(host, port, auth, {"seconds": seconds, "more": BURST_ROUNDS},
                      lambda conn: _stream(conn, payload, seconds))
    rate = reply["bytes"] / reply["seconds"]
    if not rate <= MAX_LINK_RATE:
        raise VGraphError(f"--peer {host}:{port}: the reply claims {reply['bytes']} bytes in {reply['seconds']!r} s, "
                          f"over {MAX_LINK_RATE:.0e} bytes/s: not a measurement (not a `vgraph probe --serve`?)")
    # a quarter second at that rate, but never more than the stream itself carried: a peer's figures size
    # what is sent, never what is allocated (the transfer reuses one 1 MiB buffer)
    size = max(1 << 20, min(int(rate * BURST_SECONDS), reply["bytes"]))
    bursts = []
    for left in range(BURST_ROUNDS - 1, -1, -1):
        def send(conn: socket.socket) -> int:
            time.sleep(BURST_IDLE_S)  # the bucket refills while the link idles
            view, left_to_send = memoryview(payload), size
            while left_to_send > 0:
                left_to_send -= conn.send(view[:left_to_send])
            return size
        bursts.append(burst_of(_transfer(host, port, auth, {"seconds": 0, "more": left, "curve": True}, send), size))
    return rate, int(statistics.median(bursts))


def burst_of(reply: dict, size: int) -> float:
    """The bytes that arrived ahead of a transfer's steady rate: the intercept at the first arrival of a
    least-squares line through the arrival points after the first third of the bytes (0 when none)."""
    curve = reply.get("curve")
    if not isinstance(curve, list) or len(curve) > MAX_CURVE or not all(
            isinstance(p, list) and len(p) == 2 and number_or_none(p[0], low=0, high=MAX_SERVE_S + 60) is not None
            and number_or_none(p[1], low=0, high=size) is not None for p in curve):
        raise VGraphError("the peer's arrival times are malformed (not a `vgraph probe --serve`?)")
    points = [(float(t), float(b)) for t, b in curve if b >= size / 3]
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt, mb = sum(t for t, _ in points) / n, sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return 0.0
    slope = sum((t - mt) * (b - mb) for t, b in points) / var
    return min(float(size), max(0.0, mb - slope * mt))


def _stream(conn: socket.socket, payload: bytes, seconds: float) -> int:
    end, sent = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        conn.sendall(payload)
        sent += len(payload)
    return sent


def _transfer(host: str, port: int, auth: bytes, header: dict, send: Callable[[socket.socket], int]) -> dict:
    """One connection to the peer: the secret's line, the header line, what `send` sends (it returns how many bytes), then the
    peer's reply, read by the one JSON reader and its figures bounded: at least one byte and at most what
    was sent, in a normal number of seconds no longer than a peer measures (a reply of 1e300 bytes in
    1e-300 s was an OverflowError, 1e13 bytes a 2.5 TB buffer)."""
    where = f"--peer {host}:{port}"
    try:
        with _connect(host, port) as conn:
            conn.sendall(auth + json.dumps(header).encode() + b"\n")
            sent = send(conn)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(30)
            reply = loads(conn.makefile("rb").readline(1 << 16) or b"null", f"{where}'s reply")
    except OSError as exc:
        raise VGraphError(f"{where}: the link measurement failed ({exc}); is `vgraph probe --serve` "
                          f"running there?") from None
    except VGraphError as exc:
        raise VGraphError(f"{where}: no measurement came back ({exc.diagnostics[0]}; not a `vgraph probe "
                          f"--serve`?)") from None
    if not isinstance(reply, dict):
        raise VGraphError(f"{where}: no measurement came back (not a `vgraph probe --serve`?)")
    try:
        reply["bytes"] = checked_number(reply.get("bytes"), "the bytes it counted", integer=True, low=1, high=sent)
        reply["seconds"] = checked_number(reply.get("seconds"), "the seconds it counted", high=MAX_SERVE_S + 60)
        if reply["seconds"] <= 0:
            raise NumberError(f"the seconds it counted must be > 0, got {reply['seconds']!r}")
    except NumberError as exc:
        raise VGraphError(f"{where}: no measurement came back ({exc}; not a `vgraph probe --serve`?)") from None
    return reply


def _connect(host: str, port: int) -> socket.socket:
    """A connection to the peer, retried for CONNECT_PATIENCE_S while it refuses (it may still be starting)."""
    deadline = time.monotonic() + CONNECT_PATIENCE_S
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def serve(addr: str, port: int, *, once: bool = False, ready: threading.Event | None = None,
          token: str | None = None) -> None:
    """Count what each --peer sends, one at a time, and tell it (bytes, seconds from first byte to last, and
    when asked the arrival curve).  Only connections that present the secret count (`token`, default the
    environment's); with `once`, one probe: its connections until one announces no more (at most
    MAX_ROUNDS).  `ready` is set once it listens.  No client can stop it (module docstring)."""
    from ..distributed.rendezvous import RendezvousError, check_bound

    expected = auth_line(token if token is not None else probe_token())
    addr = listen_address(addr)
    try:
        server = socket.create_server((addr, port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
    except OSError as exc:
        raise VGraphError(f"--listen {addr}:{port}: cannot listen ({exc.strerror or exc})") from None
    try:
        check_bound(server, f"--listen {addr}")
    except RendezvousError:
        server.close()
        raise
    print(f"probe: serving link measurements on {addr}:{port}", file=sys.stderr, flush=True)
    if ready is not None:
        ready.set()
    rounds = 0
    with server:
        while True:
            try:
                conn, peer = server.accept()
            except OSError as exc:  # a connection reset before it was accepted, out of descriptors: go on
                print(f"probe: accepting a connection failed ({exc.strerror or exc})", file=sys.stderr, flush=True)
                time.sleep(0.1)
                continue
            with conn:
                header = _serve_one(conn, peer, expected)
            if header is None:
                continue  # not a probe of ours (no secret, a scan, garbage): nothing counted
            rounds += 1
            more = header.get("more")
            if once and (not isinstance(more, int) or isinstance(more, bool) or more <= 0 or rounds >= MAX_ROUNDS):
                return


def _serve_one(conn: socket.socket, peer: object, expected: bytes) -> dict | None:
    """One connection: the header of an authenticated measurement, or None (refused, or failed: logged).
    Every error of one connection ends there; the server goes on."""
    try:
        conn.settimeout(10)
        reader = conn.makefile("rb", buffering=0)  # unbuffered: no payload read ahead
        if not hmac.compare_digest(reader.readline(MAX_AUTH_LINE), expected):
            print(f"probe: refused a connection from {_peer(peer)} without the shared secret", file=sys.stderr,
                  flush=True)
            return None
        return _measure_one(conn, reader)
    except Exception as exc:  # noqa: BLE001 - one client's failure must not stop the server
        print(f"probe: a connection from {_peer(peer)} failed: {quote(str(exc) or type(exc).__name__, 200)}",
              file=sys.stderr, flush=True)
        return None


def _peer(peer: object) -> str:
    return quote(str(peer[0]) if isinstance(peer, tuple) and peer else str(peer), 80)


def _read_header(reader) -> dict | None:
    """The measurement's header: one line of at most 1 KiB, a flat JSON object (None otherwise)."""
    try:
        header = loads(reader.readline(1024), "a peer's header", max_depth=1)
    except VGraphError:
        return None
    return header if isinstance(header, dict) else None


def _measure_one(conn: socket.socket, reader) -> dict | None:
    """One measurement after the secret; the header the peer sent (None when it sent none that reads)."""
    header = _read_header(reader)
    if header is None:
        return None
    curve = header.get("curve") is True
    total, first, last = 0, None, None
    points: list[tuple[float, int]] = []
    buf = bytearray(1 << 20)
    deadline = time.monotonic() + MAX_SERVE_S
    try:
        while time.monotonic() < deadline:
            n = conn.recv_into(buf)
            if not n:
                break
            last = time.perf_counter()
            first = first or last
            total += n
            if curve:
                points.append((last - first, total))
        reply: dict = {"bytes": total, "seconds": (last or 0) - (first or 0)}
        if curve:
            step = max(1, -(-len(points) // MAX_CURVE))
            reply["curve"] = [[round(t, 7), b] for t, b in points[::step]]
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass
    return header


__all__ = ["register_probe", "run_probe", "measure_link", "serve", "host_port", "probe_token", "auth_line"]
