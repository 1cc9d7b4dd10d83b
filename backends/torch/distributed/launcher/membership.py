"""Several machines: the launchers' own channel, so that a machine lost with its link is noticed within a
bounded time and every launcher takes the same decision about it.

Without it, a machine whose link goes dark is noticed only by gloo, when a collective waits longer than
--comm-timeout (300 s by default, and it must stay that long: a checkpoint or a validation legitimately
keeps peers waiting); and each launcher then decides on its own, which is fine for `restart` (everybody
restarts) but not for `shrink`, where all must drop the same replicas.

How (`--nnodes N > 1` only):

* machine 0's launcher serves this channel on `--master-addr`, port `--master-port` - 1 (its workers'
  rendezvous keeps `--master-port` + attempt); every line, both ways, is sealed with an HMAC-SHA256 keyed
  by the run's shared secret (VGRAPH_LAUNCH_TOKEN), which is never sent, and a line whose seal does not
  check is dropped unread: nothing from outside the run reaches the JSON reader, however nested or large;
* every other launcher beats every HEARTBEAT_S seconds (a quarter of --link-timeout when that is
  shorter); machine 0 counts a machine lost when nothing came from it for `--link-timeout` seconds
  (default 10), and a machine counts machine 0 lost when no answer came for as long.  Both clocks start
  at the last beat before the link went dark, so **a lost link is detected within --link-timeout seconds**
  (whatever --comm-timeout is), on both sides; the launcher that notices stops its workers (they would
  wait in gloo until --comm-timeout; SIGTERM, SIGKILL after 5 s) and the attempt ends;
* when an attempt fails anywhere, machine 0 tells the others to stop theirs (in its answer to their next
  beat), every machine reports which of its PNodes lost their worker (killed, crashed) and any user-facing
  error, and machine 0 decides (`decide`): with `restart` it waits for every machine, a silent one for
  one --link-timeout more (a machine whose link comes back within it rejoins, and every worker restarts),
  then counts it gone: the next attempt is re-planned on the PNodes left, from the survivors' rescue shards
  (training/rescue.py) or the last checkpoint; with `shrink` it does not wait for machines already silent:
  their PNodes are lost, and every launcher drops the replicas that hold one.  The others read the decision
  and act on it, so all agree.

Machine 0 is the first *coordinator*: it holds the run directory and the rank-0 worker.  Every beat's answer
carries the machines' addresses (each follower says its own), so every machine knows where the others are;
with `--on-failure shrink` the coordinator role can move when machine 0 is lost (succession.py: the lowest
surviving machine takes over, serving this channel on its own address and the same port); otherwise the
other machines give up after --comm-timeout + --link-timeout without reaching it.  "Machine 0" below means
the coordinator of the moment.  Who serves as the coordinator is asked on this channel, so it is answered
here: `serving` (machine k answers as the coordinator), `elect` (the lowest surviving machine that does, as
this machine sees it) and `rival` (a lower one serving too, while a successor collects reports).

Why plain sockets and not torch's TCPStore, which the workers' rendezvous uses: a TCPStore client call on
a link that goes dark blocks until the link returns, whatever its timeout (measured on the netlab
testbed: `add` with a 2 s timeout returned after 8 s, when the cut link came back), so a heartbeat on it
would hang exactly when it is needed.  Here every request is a fresh connection with 2 s socket
timeouts: one line of JSON each way.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from vgraph.base.diagnostics import VGraphError
from vgraph.base.jsonio import loads

from ..rendezvous import RendezvousError, _family, check_bound, check_listen_addr

HEARTBEAT_S = 1.0
REQUEST_TIMEOUT_S = 2.0
MAX_LINE = 1 << 20  # a report names PNodes and carries an error text: far less
CHUNK_BYTES = 512 * 1024  # raw bytes of a file in one line (elastic.py, shard_transfer.py): base64, 683 KiB
FETCH_TIMEOUT_S = 60.0  # one chunk over a slow link: 512 KiB at 100 kB/s is 5 s, so 60 s is generous
if 4 * (CHUNK_BYTES + 2) // 3 + 4096 >= MAX_LINE:  # a chunk's line must fit the channel's
    raise ImportError("membership.CHUNK_BYTES is too large for membership.MAX_LINE")


class MachineLost(Exception):
    """This machine cannot reach machine 0 any more (the run goes on there without it, or stops)."""


class SteppedDown(Exception):
    """A successor found a coordinator of lower rank serving too: it follows that one (`args[0]`)."""


def own_address(addr: str, port: int) -> str:
    """The address this machine reaches (addr, port) from: the one the others can reach it at (a connected
    UDP socket sends nothing; the kernel picks the route's source address)."""
    try:
        with socket.socket(_family(addr), socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return str(s.getsockname()[0])
    except OSError:
        return addr


def _digest(token: str) -> str:
    return hashlib.sha256(("vgraph-machines:" + token).encode()).hexdigest()


def _seal(key: str, message: dict) -> bytes:
    """One line of the channel: the HMAC of the JSON body, a space, the body."""
    body = json.dumps(message).encode()
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"


def _unseal(key: str, line: bytes, where: str) -> Any:
    """The message of a sealed line, or None when its seal does not check; only then is it parsed, by the
    one JSON reader (a VGraphError for a sealed line that is not JSON: a peer's bug, never an outsider)."""
    seal, _, body = line.rstrip(b"\n").partition(b" ")
    if not hmac.compare_digest(seal, hmac.new(key.encode(), body, hashlib.sha256).hexdigest().encode()):
        return None
    return loads(body, where)


def channel_key(token: str) -> str:
    """The channel's HMAC key, derived from the run's secret (which is never sent)."""
    return _digest(token)


def ask(addr: str, port: int, key: str, message: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """One sealed request to machine 0's launcher and its sealed answer: a fresh connection with `timeout`
    on every socket operation; OSError/ValueError when it fails (a request without the run's secret gets no
    answer at all: ValueError)."""
    with socket.create_connection((addr, port), timeout=timeout) as conn:
        conn.sendall(_seal(key, message))
        line = conn.makefile("rb").readline(MAX_LINE + 1)
    if not line:
        raise ValueError("machine 0 refused the request (another run's secret?)")
    try:
        reply = _unseal(key, line, f"machine 0's launcher at {addr}:{port}")
    except VGraphError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(reply, dict):
        raise ValueError("machine 0's answer is not sealed with the run's secret, or not an object")
    return reply


@dataclass
class _Board:
    """Machine 0's record of the run: beats, aborted attempts, reports, decisions.  Guarded by `lock`."""

    beats: dict[int, tuple[int, float]] = field(default_factory=dict)  # machine -> (count, when it changed)
    aborted: set[int] = field(default_factory=set)
    reports: dict[tuple[int, int], dict] = field(default_factory=dict)  # (attempt, machine) -> report
    plans: dict[int, dict] = field(default_factory=dict)  # attempt -> the decision that starts it
    taken: dict[int, set[int]] = field(default_factory=dict)  # attempt -> machines that read its plan
    lock: threading.Lock = field(default_factory=threading.Lock)
    extra: Callable[[dict], dict] | None = None  # the requests of an elastic run: joins, files, jobs (elastic.py)
    mirror: Callable[[dict], dict] | None = None  # the run's history for the machines next in line (succession.py)
    coordinator: int = 0  # the machine serving this board: 0, or a successor (succession.py)
    addrs: dict[int, str] = field(default_factory=dict)  # machine -> the address it said it has (its beats)
    on_addrs: Callable[[dict[int, str]], None] | None = None  # told when `addrs` changes (succession.py records it)

    def answer(self, request: dict) -> dict:
        op, machine, attempt = request.get("op"), int(request.get("machine", -1)), int(request.get("attempt", -1))
        if op == "coordinator":  # who serves here: a returning machine 0 or a rival successor asks (succession.py)
            return {"coordinator": self.coordinator}
        if op in ("mirror", "mirror-fetch") and self.mirror is not None:
            with self.lock:
                self.beats[machine] = (self.beats.get(machine, (0, 0.0))[0] + 1, time.monotonic())
            return self.mirror(request)
        if op not in ("beat", "report", "plan") and self.extra is not None:
            if machine >= 0:
                with self.lock:
                    count, _ = self.beats.get(machine, (0, 0.0))
                    self.beats[machine] = (count + 1, time.monotonic())
            return self.extra(request)
        with self.lock:
            count, _ = self.beats.get(machine, (0, 0.0))
            self.beats[machine] = (count + 1, time.monotonic())  # any request is a sign of life
            if op == "beat":
                addr = request.get("addr")
                changed = (isinstance(addr, str) and 0 < len(addr) <= 255 and addr.isprintable() and machine >= 0
                           and self.addrs.get(machine) != addr)
                if changed:
                    self.addrs[machine] = addr
                reply = {"abort": attempt in self.aborted, "coordinator": self.coordinator,
                         "machines": {str(m): a for m, a in self.addrs.items()}}
                table = dict(self.addrs)
        if op == "beat":
            if changed and self.on_addrs is not None:
                self.on_addrs(table)
            return reply
        with self.lock:
            if op == "report":
                self.reports[(attempt, machine)] = dict(request.get("report") or {})
                return {"ok": True}
            if op == "plan":
                plan = self.plans.get(attempt)
                if plan is not None:
                    self.taken.setdefault(attempt, set()).add(machine)
                return {"plan": plan}
        if op == "join":  # machine 0 still preparing the run (data, placement): its answer to joins comes next
            return {"wait": "machine 0 is preparing the run"}
        return {"error": f"unknown request {op!r}"}


class _Handler(socketserver.StreamRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        try:
            line = self.rfile.readline(MAX_LINE + 1)
            request = _unseal(server.key, line, "a launcher's request") if len(line) <= MAX_LINE else None
        except (OSError, VGraphError):
            return
        if not isinstance(request, dict):
            return  # no answer to whoever lacks the run's secret
        try:
            reply = server.board.answer(request)
        except (TypeError, ValueError):
            reply = {"error": "malformed request"}
        try:
            self.wfile.write(_seal(server.key, reply))
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: str, port: int, key: str, board: _Board) -> None:
        self.address_family = _family(addr)
        self.key, self.board = key, board
        check_listen_addr(addr, "--master-addr")  # the one check of every listener (rendezvous.py)
        super().__init__((addr, port), _Handler)
        try:
            check_bound(self.socket, f"--master-addr {addr}")
        except RendezvousError:
            self.server_close()
            raise


class _Succession:
    """The part of a machine's channel that lets the coordinator role move (succession.py): where the others
    are, taking the role over, following another coordinator.  Mixed into `Machines`, whose state it uses."""

    addrs: dict[int, str]
    coordinator: int

    def take_over(self, lost: int, survivors: set[int]) -> None:
        """This machine becomes the coordinator (succession.py): it serves the channel on its own address and
        the same port, watching `survivors` (they report the failed attempt here).  RendezvousError when it
        cannot listen there."""
        self.coordinator = self.node_rank
        with self._board.lock:
            self._board.addrs = {m: a for m, a in self.addrs.items() if m != lost}
            self._board.beats = {}
        self._serve(self.own_addr, "the launchers' channel, taken over from the lost coordinator")
        self.addr = self.own_addr
        self._watched = set(survivors) - {self.node_rank}

    def on_addresses(self, record: Callable[[dict[int, str]], None]) -> None:
        """The coordinator: `record` the machines' addresses now and whenever a beat changes them."""
        board = self._board
        with board.lock:
            board.addrs[self.node_rank] = self.own_addr
            board.on_addrs, table = record, dict(board.addrs)
        record(table)

    def step_down(self, to: int) -> None:
        """Stop serving and follow machine `to`, a coordinator of lower rank (succession.py's tie rule)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.follow(to)

    def follow(self, to: int) -> None:
        """Beat and report to machine `to`, the new coordinator, at its address and the same port."""
        self.coordinator, self.addr = to, self.addrs[to]
        self._last_reply = time.monotonic()

    def _learn(self, table: Any) -> None:
        """The machines' addresses from the coordinator's answer (where to look for a successor)."""
        if isinstance(table, dict):
            learnt = {int(m): a for m, a in table.items() if str(m).isdigit() and isinstance(a, str)}
            learnt.setdefault(self.coordinator, self.addr)
            self.addrs = learnt


class Machines(_Succession):
    """This launcher's link to the run's other machines (inactive on one machine); see the module docstring."""

    def __init__(self) -> None:
        self.active = False
        self.node_rank = 0
        self._server: _Server | None = None
        self._board = _Board()
        self._stop = threading.Event()
        self._attempt = 0
        self._watched: set[int] = set()
        self._last_reply = time.monotonic()
        self._abort_seen = -1
        self.coordinator = 0  # the machine that serves the channel: 0 until a successor takes over (succession.py)
        self.own_addr = ""  # the address the others reach this machine at (told in every beat)
        self.addrs: dict[int, str] = {}  # machine -> address, from the coordinator's answers
        self.superior: Callable[[], int | None] | None = None  # a successor's check for a lower-ranked rival

    # -- set-up -------------------------------------------------------------------------------
    def open(self, addr: str, port: int, token: str, node_rank: int, nnodes: int, link_timeout: float,
             rejoin_timeout: float) -> None:
        """Machine 0: serve on (addr, port); the others: reach it (waiting up to `rejoin_timeout` for it to
        start), then beat in a thread."""
        self.addr, self.port, self.key = addr, port, _digest(token)
        self.node_rank, self.nnodes = node_rank, nnodes
        self.own_addr = addr if node_rank == 0 else own_address(addr, port)
        self.link_timeout, self.rejoin_timeout = link_timeout, rejoin_timeout
        if not 1 <= port <= 65535:
            raise RendezvousError(f"the launchers' channel uses --master-port - 1 = {port}: choose a --master-port "
                                  f"between 2 and 65535")
        if node_rank == 0:
            self._serve(addr, "--master-port - 1, the launchers' channel")
        else:
            deadline = time.monotonic() + rejoin_timeout
            while True:
                try:
                    self._learn(self._request("beat", attempt=-1, addr=self.own_addr).get("machines"))
                    break
                except (OSError, ValueError):
                    if time.monotonic() > deadline:
                        raise MachineLost(f"cannot reach machine 0's launcher at {addr}:{port} (--master-port - 1) "
                                          f"within {rejoin_timeout:g} s: is it started, with the same "
                                          f"VGRAPH_LAUNCH_TOKEN?") from None
                    time.sleep(0.5)
            self._last_reply = time.monotonic()
            threading.Thread(target=self._beat, args=(min(HEARTBEAT_S, link_timeout / 4),), daemon=True).start()
        self.active = True

    def _serve(self, addr: str, what: str) -> None:
        try:
            self._server = _Server(addr, self.port, self.key, self._board)
        except OSError as exc:
            raise RendezvousError(f"cannot listen on {addr}:{self.port} ({what}): {exc.strerror or exc}") from None
        with self._board.lock:
            self._board.coordinator = self.coordinator
            self._board.addrs[self.node_rank] = addr
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.active = False

    def serve_mirror(self, handler: Callable[[dict], dict]) -> None:
        """The coordinator: answer the mirror requests of the machines next in line with `handler` (succession.py)."""
        self._board.mirror = handler

    def serve_extra(self, handler: Callable[[dict], dict]) -> None:
        """Machine 0: answer the requests this module does not know with `handler` (elastic.py's joins)."""
        self._board.extra = handler

    def _request(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **fields: Any) -> dict:
        """One request to machine 0 (`ask`) as this machine."""
        return ask(self.addr, self.port, self.key, {"op": op, "machine": self.node_rank, **fields}, timeout)

    def request(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **fields: Any) -> dict:
        """One request to machine 0 as this machine; OSError/ValueError when it fails (elastic.py)."""
        reply = self._request(op, timeout, **fields)
        self._last_reply = time.monotonic()
        return reply

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            if self.node_rank == self.coordinator:  # taken over: this machine is beaten, it does not beat
                continue
            attempt = self._attempt
            try:
                reply = self._request("beat", attempt=attempt, addr=self.own_addr)
            except (OSError, ValueError):
                continue
            self._last_reply = time.monotonic()
            self._learn(reply.get("machines"))
            if reply.get("abort"):
                self._abort_seen = attempt

    # -- an attempt ---------------------------------------------------------------------------
    def begin(self, attempt: int, machines: set[int]) -> None:
        """Attempt `attempt` starts with workers on `machines` (machine 0 watches those that beat)."""
        self._attempt = attempt
        self._watched = set(machines) - {self.coordinator}
        now = time.monotonic()
        with self._board.lock:  # the silence that counts starts now, not during the last decision
            self._board.beats = {m: (count, now) for m, (count, _) in self._board.beats.items()}

    def silent(self, for_s: float | None = None) -> list[int]:
        """Machine 0: the watched machines whose beats stopped for --link-timeout (or `for_s`; a machine that
        never beat yet is still starting: the workers' rendezvous waits for it)."""
        now, limit = time.monotonic(), self.link_timeout if for_s is None else for_s
        with self._board.lock:
            return sorted(m for m in self._watched
                          if m in self._board.beats and now - self._board.beats[m][1] > limit)

    def trouble(self) -> str | None:
        """Why this machine must stop its workers now, or None (polled while they run)."""
        if not self.active:
            return None
        if self.node_rank == self.coordinator:
            silent = self.silent()
            if silent:
                return (f"machine(s) {', '.join(map(str, silent))} silent for {self.link_timeout:g} s "
                        f"(--link-timeout): link lost?")
            with self._board.lock:
                told = sorted(m for (a, m) in self._board.reports if a == self._attempt)
            return f"machine(s) {', '.join(map(str, told))} reported a failure" if told else None
        if self._abort_seen == self._attempt:
            return f"machine {self.coordinator} stopped attempt {self._attempt}"
        if time.monotonic() - self._last_reply > self.link_timeout:
            return f"no answer from machine {self.coordinator} for {self.link_timeout:g} s (--link-timeout): link lost?"
        return None

    def settle(self, report: dict, decide: Callable[[dict[int, dict], list[int]], dict], wait_for_all: bool) -> dict:
        """After this attempt failed here: report it, and return machine 0's decision for the next one.

        Machine 0 waits for the others' reports (`wait_for_all`: up to the rejoin timeout for every watched
        machine; else only for those not silent, up to --link-timeout), calls `decide(reports, missing)` and
        publishes the result; the others wait for it up to rejoin + link timeout, else MachineLost."""
        attempt = self._attempt
        if self.node_rank == self.coordinator:
            return self._decide(attempt, report, decide, wait_for_all)
        deadline = time.monotonic() + self.rejoin_timeout + self.link_timeout
        delivered = False
        while time.monotonic() < deadline:
            try:
                if not delivered:
                    self._request("report", attempt=attempt, report=report)
                    delivered = True
                plan = self._request("plan", attempt=attempt + 1).get("plan")
            except (OSError, ValueError):
                plan = None
            if plan is not None:
                self._last_reply = time.monotonic()
                return plan
            time.sleep(0.2)
        raise MachineLost(f"machine {self.node_rank} lost contact with machine {self.coordinator} "
                          f"({self.addr}:{self.port}) and "
                          f"did not regain it within {self.rejoin_timeout + self.link_timeout:g} s; this machine's "
                          f"workers are stopped")

    def _decide(self, attempt: int, report: dict, decide: Callable[[dict[int, dict], list[int]], dict],
                wait_for_all: bool) -> dict:
        board = self._board
        with board.lock:
            board.aborted.add(attempt)
            board.reports[(attempt, self.node_rank)] = report
        deadline = time.monotonic() + (self.rejoin_timeout if wait_for_all else self.link_timeout)
        while True:
            rival = self.superior() if self.superior is not None else None
            if rival is not None:  # a successor of lower rank serves too: it wins the tie (succession.py)
                raise SteppedDown(rival)
            with board.lock:
                got = {m for (a, m) in board.reports if a == attempt}
            # A silent machine is waited for one --link-timeout more when all are (a link that comes back
            # within it rejoins), then counted gone: the run is re-planned around it.
            gone = set(self.silent(self.link_timeout * (2 if wait_for_all else 1)))
            pending = self._watched - got - gone
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        with board.lock:
            reports = {m: r for (a, m), r in board.reports.items() if a == attempt}
        plan = decide(reports, sorted(self._watched - set(reports)))
        with board.lock:
            board.plans[attempt + 1] = plan
        until = time.monotonic() + 5.0  # let the machines that reported read it before anything exits
        while time.monotonic() < until:
            with board.lock:
                if set(reports) - {self.node_rank} <= board.taken.get(attempt + 1, set()):
                    break
            time.sleep(0.05)
        return plan


def serving(machines: Any, k: int, window: float) -> bool:
    """Whether machine `k` answers as the coordinator on its address (the channel's port) within `window` s."""
    deadline = time.monotonic() + window
    while True:
        addr = machines.addrs.get(k)
        if addr:
            try:
                reply = ask(addr, machines.port, machines.key, {"op": "coordinator", "machine": machines.node_rank},
                            min(1.0, REQUEST_TIMEOUT_S))
                if reply.get("coordinator") == k:
                    return True
            except (OSError, ValueError):
                pass  # not serving yet (or gone): asked again until the window closes
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def elect(me: int, survivors: Iterable[int], serving: Callable[[int], bool]) -> int:
    """The new coordinator as this machine sees it: the lowest-ranked survivor below it that answers as the
    coordinator (`serving(k)`, which waits up to its window), else this machine itself."""
    for k in sorted(set(survivors)):
        if k >= me:
            break
        if serving(k):
            return k
    return me


def rival(machines: Any, survivors: set[int], every: float = 1.0) -> Callable[[], int | None]:
    """A successor's check while it collects reports, at most once per `every` s: a survivor of lower rank
    serving as coordinator too (two machines thought themselves next), or None."""
    last = [0.0]

    def check() -> int | None:
        if time.monotonic() - last[0] < every:
            return None
        last[0] = time.monotonic()
        lower = sorted(k for k in survivors if k < machines.node_rank)
        return next((k for k in lower if serving(machines, k, 0.0)), None)
    return check


def follow_successor(machines: Any, successors: list[int], report: dict | None, window: float,
                     send: Callable[[], Any] = lambda: None, say: Callable[[str], None] = lambda line: None) -> dict:
    """A machine that may not take the coordinator's role (one that joined an elastic run and holds no job
    yet, or whose run's --on-failure moves no role: attempts.JoinedSuccession), after it lost the coordinator:
    follow the lowest of `successors` above the lost one that serves the channel within `window` s each (they
    elect among themselves by rank: succession.succeed), send it this machine's shards (`send`), report, and
    return its decision; without a `report` (the machine was waiting for a job, not running one), only
    follow: {}.  MachineLost when none serves: the run cannot go on without
    a coordinator, and this machine says so instead of waiting on silence."""
    lost = machines.coordinator
    for k in sorted(k for k in set(successors) if k > lost and k != machines.node_rank):
        if serving(machines, k, window):
            machines.follow(k)
            say(f"launch: machine {k} ({machines.addr}) is the coordinator now; this machine follows it")
            if report is None:
                return {}
            send()
            return machines.settle(report, lambda reports, missing: {}, wait_for_all=True)
    named = ", ".join(map(str, sorted(successors))) or "none: no other machine is in the run"
    raise MachineLost(f"machine {lost}, the coordinator, is lost and no machine that may take its role ({named}) "
                      f"serves the launchers' channel: the run cannot go on (its run directory is machine {lost}'s)")


def decide(reports: dict[int, dict], missing: list[int], home: dict[str, int], on_failure: str) -> dict:
    """Machine 0's decision after a failed attempt, from every machine's report ({"lost": PNodes whose
    worker died there, "described": how, "error": a user-facing error or ""}) and the machines that did not
    report: {"lost": PNodes, "described": text, "error": text}.

    A user-facing error anywhere stops the run with it.  Machines that did not report lost all their PNodes
    (`home`: PNode -> machine), and only those count then (the workers of the others failed because of
    them); they are `gone`: with `restart` the next attempt is re-planned on the PNodes left (its state
    rescued from the survivors' shards, training/rescue.py), with `shrink` their replicas are dropped."""
    errors = [r.get("error") for _, r in sorted(reports.items()) if r.get("error")]
    if errors:
        return {"lost": [], "described": "", "error": errors[0]}
    if missing:
        lost = sorted(p for p, m in home.items() if m in missing)
        described = ", ".join(f"{p} (machine {home[p]}, unreachable)" for p in lost)
        return {"lost": lost, "described": described, "error": "", "gone": lost}
    lost = sorted({p for r in reports.values() for p in r.get("lost", [])})
    described = "; ".join(r["described"] for _, r in sorted(reports.items()) if r.get("described"))
    return {"lost": lost, "described": described, "error": ""}


__all__ = ["Machines", "MachineLost", "SteppedDown", "own_address", "decide", "ask", "channel_key", "serving", "elect",
           "rival",
           "follow_successor", "HEARTBEAT_S",
           "REQUEST_TIMEOUT_S", "MAX_LINE", "CHUNK_BYTES", "FETCH_TIMEOUT_S"]
