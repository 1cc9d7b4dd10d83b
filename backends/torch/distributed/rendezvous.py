"""Where `vgraph launch`'s workers find each other, and who may join.

torch.distributed's default rendezvous (`env://`) starts a TCPStore server
that listens on every interface without authentication, even when
MASTER_ADDR is 127.0.0.1: another host could read and write its keys.  Here
rank 0 binds the listening socket itself, to MASTER_ADDR only, and hands it
to the store (`master_listen_fd`); every key lives under a prefix derived
from a shared secret (VGRAPH_LAUNCH_TOKEN), so a process that does not
present the token finds no key of the run and cannot take a rank's place.

One machine: the launcher makes a fresh random token per run and gives it to
its workers in their environment.  Several machines: every launcher must get
the same token in VGRAPH_LAUNCH_TOKEN (e.g. `export VGRAPH_LAUNCH_TOKEN=$(openssl
rand -hex 16)` copied to each machine); the launcher refuses to start
without one.  The traffic itself is not encrypted (README: "Several machines").

Under srun (launchers.py) the workers rendezvous the same way, rank 0 on the
first node of the allocation: VGRAPH_LAUNCH_TOKEN must be set in the job
script (srun passes the environment on).  Under torchrun the rendezvous is
torchrun's own (its c10d store on --rdzv-endpoint, which authenticates no
one: keep that endpoint on a private network, docs/distributed.md); with
VGRAPH_LAUNCH_TOKEN set, the workers' process-group keys on torchrun's store
sit behind the secret's prefix as here, so a process without it cannot take a
rank's place in the process group.

The launcher also probes the rendezvous port before it starts any worker: a
port in use is a diagnostic, not a worker traceback and a burnt restart.
"""
from __future__ import annotations

import errno
import hashlib
import ipaddress
import os
import secrets
import socket
from datetime import timedelta
from typing import Any, Mapping

from vgraph.base.diagnostics import VGraphError

TOKEN_ENV = "VGRAPH_LAUNCH_TOKEN"
MIN_TOKEN_CHARS = 16
MIN_TOKEN_DISTINCT = 8


class RendezvousError(VGraphError):
    """The rendezvous cannot happen as asked (a busy port, a missing token)."""


def new_token() -> str:
    return secrets.token_hex(16)


def check_token(token: str | None, nnodes: int) -> str:
    """The run's token: the environment's, or (one machine only) a fresh one."""
    if token:
        if (len(token) < MIN_TOKEN_CHARS or not token.isprintable() or any(c.isspace() for c in token)
                or len(set(token)) < MIN_TOKEN_DISTINCT):
            raise RendezvousError(f"{TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} printable characters, no "
                                  f"spaces, at least {MIN_TOKEN_DISTINCT} of them different (16 spaces or one "
                                  f"letter repeated are no secret; e.g. the output of: openssl rand -hex 16)")
        return token
    if nnodes > 1:
        raise RendezvousError(f"several machines need a shared secret: set {TOKEN_ENV} to the same value on "
                              f"every machine (e.g. export {TOKEN_ENV}=$(openssl rand -hex 16)); the rendezvous "
                              f"port is reachable by other hosts")
    return new_token()


LOOPBACK = "127.0.0.1"  # where every listener listens unless it is given an address


def is_wildcard(addr: str) -> bool:
    """Whether binding `addr` listens on every interface, in any spelling: 0.0.0.0 and its legacy forms
    ('0', '0.0', '0x0'), '::' and its long forms, IPv4-mapped or -compatible IPv6 of 0.0.0.0
    ('::ffff:0.0.0.0', '::ffff:0:0'), with brackets or a zone, an empty name or '*'."""
    plain = addr.strip().strip("[]").strip()
    plain = plain.split("%", 1)[0]  # an IPv6 zone ('::%eth0') binds the same address
    if plain in ("", "*"):
        return True
    try:
        if socket.inet_aton(plain) == b"\0\0\0\0":  # also the legacy forms '0', '0.0', '0x0'
            return True
    except (OSError, ValueError):
        pass
    try:
        ip = ipaddress.ip_address(plain)
    except ValueError:
        return False
    if ip.is_unspecified:
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped
        compatible = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if int(ip) >> 32 == 0 else None
        return any(v is not None and v.is_unspecified for v in (mapped, compatible))
    return False


def check_listen_addr(addr: str | None, what: str) -> str:
    """The address a listener of vgraph binds (launch's rendezvous store and launchers' channel, the
    workers' store, `probe --serve`): LOOPBACK when none is given, never a wildcard in any spelling
    (`is_wildcard`): a wildcard listens on every interface of the machine, which the README promises
    never happens.  The one check every listener applies; `check_bound` checks the socket once bound."""
    if addr is None:
        return LOOPBACK
    if not isinstance(addr, str) or not addr.isprintable():
        raise RendezvousError(f"{what} {addr!r} holds control characters: not an address")
    if is_wildcard(addr):
        raise RendezvousError(f"{what} {addr!r} means every interface of this machine; give the address the "
                              f"others reach this machine on ({LOOPBACK} on one machine)")
    return addr


def check_bound(sock: socket.socket, what: str) -> None:
    """After bind: refuse a socket that listens on every interface after all (a host name that resolves to
    0.0.0.0, a spelling `is_wildcard` does not know).  The socket is closed then."""
    try:
        bound = sock.getsockname()[0]
    except OSError:
        return
    if is_wildcard(str(bound)):
        sock.close()
        raise RendezvousError(f"{what} resolves to {bound}, every interface of this machine; give the address "
                              f"the others reach this machine on ({LOOPBACK} on one machine)")


def check_master_addr(addr: str) -> str:
    """`--master-addr` unless it is a wildcard (`check_listen_addr`): machine 0 listens on it."""
    return check_listen_addr(addr, "--master-addr")


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def probe_port(addr: str, port: int) -> None:
    """Raise RendezvousError unless (addr, port) can be listened on now."""
    if not 1 <= port <= 65535:
        raise RendezvousError(f"port {port} is outside 1..65535 (after a restart the port is --master-port "
                              f"+ attempt); choose a lower --master-port")
    try:
        with socket.socket(_family(addr), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            check_bound(s, f"--master-addr {addr}")
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise RendezvousError(f"port {port} on {addr} is in use; choose another --master-port") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
            raise RendezvousError(f"--master-addr {addr} is not an address of this machine (machine 0 must "
                                  f"listen on it): {exc.strerror or exc}") from None
        if exc.errno == errno.EACCES:
            raise RendezvousError(f"port {port} on {addr} needs privileges; choose a port above 1023") from None
        raise RendezvousError(f"cannot listen on {addr}:{port}: {exc.strerror or exc}") from None


def free_port(addr: str = "127.0.0.1") -> int:
    """A port free on `addr` right now."""
    with socket.socket(_family(addr), socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def interface_towards(addr: str) -> str | None:
    """The name of this machine's network interface that reaches `addr`, None for a loopback address (or
    when no interface has the address the route picks).

    Why: gloo binds each worker to the address this machine's hostname resolves to, and many machines
    resolve it to 127.0.0.1 or 127.0.1.1 (/etc/hosts).  A worker on another machine is then told to
    connect to a loopback address and the run hangs in its first collective.  The launcher therefore
    names, in GLOO_SOCKET_IFNAME, the interface on the route to the master (what the kernel would
    send from), unless the user set it."""
    family = _family(addr)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = ipaddress.ip_address(s.getsockname()[0])
    except (OSError, ValueError):
        return None
    if local.is_loopback:
        return None
    for _, name in socket.if_nameindex():
        if local in _addresses(name, family):
            return name
    return None


def _addresses(name: str, family: socket.AddressFamily) -> set:
    """The addresses of interface `name` in `family` (Linux: an ioctl for IPv4, /proc/net/if_inet6 for IPv6)."""
    if family == socket.AF_INET6:
        try:
            rows = [line.split() for line in open("/proc/net/if_inet6", encoding="ascii")]
        except OSError:
            return set()
        return {ipaddress.ip_address(":".join(r[0][i:i + 4] for i in range(0, 32, 4))) for r in rows
                if len(r) == 6 and r[5] == name}
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        return {ipaddress.ip_address(packed[20:24])}
    except (OSError, ImportError):
        return set()


def gloo_environment(addr: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """{GLOO_SOCKET_IFNAME: the interface towards `addr`} for a worker, when the user did not name one and
    `addr` is not loopback; else {} (see `interface_towards`)."""
    if (os.environ if env is None else env).get("GLOO_SOCKET_IFNAME"):
        return {}
    name = interface_towards(addr)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


def rendezvous_store(rank: int, world: int, timeout: timedelta, env: dict[str, str] | None = None):
    """The store every worker of one attempt joins: served by rank 0 on MASTER_ADDR only, keys under
    the token's prefix.  `env` defaults to os.environ (MASTER_ADDR, MASTER_PORT, the token)."""
    import torch.distributed as dist

    env = dict(os.environ if env is None else env)
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
    token = env.get(TOKEN_ENV)
    if not token:
        raise RendezvousError(f"{TOKEN_ENV} is not set: start workers with `vgraph launch`, or set it to the "
                              f"same secret for every rank")
    check_token(token, 1)  # the rules `vgraph launch` applies hold for srun and hand-started workers too
    if rank == 0:
        check_listen_addr(addr, "MASTER_ADDR")  # hand-started and srun workers too, not only launch's
        sock = socket.socket(_family(addr), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            check_bound(sock, f"MASTER_ADDR {addr}")
            sock.listen(max(64, world))
        except OSError as exc:
            sock.close()
            raise RendezvousError(f"cannot listen on {addr}:{port}: {exc.strerror or exc}") from None
        store = dist.TCPStore(addr, port, world, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore(addr, port, world, False, timeout)
    return dist.PrefixStore(_prefix(token), store)


def _prefix(token: str) -> str:
    return "vgraph-" + hashlib.sha256(token.encode()).hexdigest()[:32]


def process_group_store(place: Any, timeout: timedelta, env: Mapping[str, str] | None = None):
    """The store a worker's `init_process_group` joins.

    `place` (launchers.WorkerPlace) says who started the worker: `vgraph launch` and srun rendezvous here
    (`rendezvous_store`, the token required); torchrun on its own store, behind the token's prefix when
    one is set, and a prefix per restart."""
    import torch.distributed as dist

    env = dict(os.environ if env is None else env)
    token = env.get(TOKEN_ENV)
    if place.launcher == "torchrun":
        # torchrun's agents share one store across restarts (TORCHELASTIC_USE_AGENT_STORE), and the keys a
        # process group leaves there (each rank's address) outlive a failed worker set: a restarted set
        # read the dead ranks' addresses and timed out connecting (torch 2.13, gloo).  Each restart's keys
        # therefore get a prefix of their own; the secret's prefix sits above it when one is set.
        store, _, _ = next(dist.rendezvous("env://", place.rank, place.world, timeout=timeout))
        if token:
            check_token(token, 1)  # long enough, printable
            store = dist.PrefixStore(_prefix(token), store)
        return dist.PrefixStore(f"vgraph-restart-{place.restart}", store)
    if token is None and place.launcher == "slurm":
        raise RendezvousError(f"{TOKEN_ENV} is not set: under srun every task must get the same secret "
                              f"(export {TOKEN_ENV}=$(openssl rand -hex 16) in the job script, before srun)")
    return rendezvous_store(place.rank, place.world, timeout,
                            {**env, "MASTER_ADDR": place.master_addr, "MASTER_PORT": str(place.master_port)})


__all__ = ["TOKEN_ENV", "LOOPBACK", "RendezvousError", "check_token", "check_master_addr", "check_listen_addr",
           "check_bound", "is_wildcard", "probe_port", "free_port", "rendezvous_store",
           "process_group_store", "new_token", "interface_towards", "gloo_environment"]
