"""Hosts on one machine: network namespaces joined by a bridge, one address each.

Host i is the namespace `<prefix>-h<i>` with `eth0` at 10.77.0.i/24, one end of a veth pair
whose other end sits on the bridge `<prefix>-br` in the root namespace; the bridge itself has
10.77.0.254, so the machine (the load generator) reaches every host. Each host has its own
network stack: its own loopback, routes and firewall, so a route or a rule set in one host
cuts or degrades what crosses the network to it and nothing else. A cut drops packets where they
arrive (nftables), so neither side is told: each learns of it by its own deadlines.

Everything the bed makes carries the prefix, so `remove_stale` takes away what a killed run
left behind (its namespaces, the processes still inside them, the bridge) before a new bed is
made. Making namespaces needs root (CAP_NET_ADMIN): `unavailable()` says why not, in one line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from testkit.proc_stat import running

PREFIX = "kvmb"
# Each host's nftables table of the peers it is cut from (bench/hosts/links.py has its own).
CUT_TABLE = "kvmb_cut"
CUT_RULES = f"""
add table inet {CUT_TABLE}
add set inet {CUT_TABLE} peers {{ type ipv4_addr; }}
add chain inet {CUT_TABLE} input {{ type filter hook input priority -10; }}
add rule inet {CUT_TABLE} input ip saddr @peers drop
"""
SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.254"
COMMAND_TIMEOUT_S = 10.0


class BedError(RuntimeError):
    """The bed could not be made; the message is one line."""


def unavailable() -> str | None:
    """Why hosts cannot be made here (one line), or None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2 is not installed)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root to test across hosts"
    if shutil.which("nft") is None:
        return "no `nft` command: the bed cuts hosts apart with nftables (install the nftables package)"
    # What a bed needs, tried once on throw-away names: a namespace, a bridge, a veth pair into it.
    probe, bridge = f"{PREFIX}-probe", f"{PREFIX}-pbr"
    steps = [(["netns", "add", probe], "a network namespace"), (["link", "add", bridge, "type", "bridge"], "a bridge"),
             (["link", "add", f"{PREFIX}-pv", "type", "veth", "peer", "name", "eth0", "netns", probe], "a veth pair")]
    try:
        for args, what in steps:
            done = _ip(*args, check=False)
            if done.returncode != 0:
                return f"cannot make {what}: {done.stderr.strip() or done.returncode}"
        return None
    finally:
        _ip("link", "delete", bridge, check=False)
        _ip("netns", "delete", probe, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise BedError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces(prefix: str) -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def remove_stale(prefix: str = PREFIX, grace_s: float = 5.0) -> list[str]:
    """Removes every namespace, process inside one, and bridge of a bed with this prefix; returns
    the namespaces it removed."""
    names = _namespaces(prefix)
    pids = {int(p) for name in names for p in _ip("netns", "pids", name, check=False).stdout.split()}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(running(pid) for pid in pids):
            time.sleep(0.1)
    for name in names:
        _ip("netns", "delete", name, check=False)
    _ip("link", "delete", f"{prefix}-br", check=False)
    # A veth whose namespace is gone goes with it, but the kernel takes its time: not left to chance.
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if link.startswith(f"{prefix}-v") or link == f"{prefix}-pv":
            _ip("link", "delete", link, check=False)
    return names


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    # Its veth's end on the bridge, in the root namespace: what this host receives leaves by it.
    outside: str

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}"

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def run(self, *command: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.argv(*command), input=stdin, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        if check and done.returncode != 0:
            raise BedError(f"{self.namespace}: {' '.join(command)}: {done.stderr.strip()}")
        return done

    def cut_from(self, other: Host) -> None:
        """Packets from `other` are dropped as they arrive here: one direction of a partition.
        The sender sees nothing (no error, no reset), as across a real network; a blackhole
        route would instead fail its sends at once."""
        self.run("nft", "add", "element", "inet", CUT_TABLE, "peers", f"{{ {other.address} }}")

    def heal_from(self, other: Host) -> None:
        """Lets packets from `other` in again (a peer that was not cut off is not an error)."""
        self.run("nft", "delete", "element", "inet", CUT_TABLE, "peers", f"{{ {other.address} }}", check=False)


@dataclass
class Bed:
    """`hosts` namespaces on one bridge; a context manager that removes everything on exit."""

    size: int
    prefix: str = PREFIX
    hosts: list[Host] = field(default_factory=list)

    def __enter__(self) -> Bed:
        if not 1 <= self.size <= 250:
            raise BedError(f"a bed has 1 to 250 hosts, not {self.size}")
        remove_stale(self.prefix)
        try:
            self._make()
        except BaseException:
            remove_stale(self.prefix)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        remove_stale(self.prefix)

    def _make(self) -> None:
        bridge = f"{self.prefix}-br"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(1, self.size + 1):
            host = Host(i, f"{self.prefix}-h{i}", f"{self.prefix}-v{i}")
            outside = host.outside
            _ip("netns", "add", host.namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            host.run("ip", "link", "set", "lo", "up")
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
            host.run("ip", "link", "set", "eth0", "up")
            host.run("nft", "-f", "-", stdin=CUT_RULES)
            self.hosts.append(host)
