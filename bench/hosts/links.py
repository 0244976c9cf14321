"""What a host's link does to its packets: loss (nftables), bandwidth (tc tbf), delay (tc netem).

A shape applies to the host's `eth0` in both directions:
- loss: an nftables table in the host's namespace drops that share of the packets arriving on
  and leaving by `eth0`, each packet drawn on its own (its loopback is untouched);
- bandwidth: a token bucket on `eth0` (what the host sends) and on its bridge-side veth (what it
  receives), so a transfer either way runs at the rate;
- delay and jitter: netem on the same two ends, where the kernel has netem. Kernels built
  without it ("Specified qdisc kind is unknown") cannot delay packets at all: `delay_unavailable`
  says so in one line and a shape that asks for delay is refused with it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache

from bench.hosts.netns import COMMAND_TIMEOUT_S, BedError, Host

TABLE = "kvmb_link"
# A token bucket's burst: large enough for one full-size packet at any rate the bed is given.
TBF_BURST = "64kb"
TBF_LATENCY = "200ms"


@dataclass(frozen=True)
class LinkShape:
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.loss_pct == 0 or 0.01 <= self.loss_pct < 100):
            raise ValueError(f"loss must be 0, or 0.01 to <100 %, got {self.loss_pct}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate must be > 0 Mbit/s, got {self.rate_mbit}")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"need 0 <= jitter <= delay, got delay {self.delay_ms} ms, jitter {self.jitter_ms} ms")

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        """`loss=2,rate=100,delay=5,jitter=1` (%, Mbit/s, ms, ms); every key optional."""
        fields = {"loss": "loss_pct", "rate": "rate_mbit", "delay": "delay_ms", "jitter": "jitter_ms"}
        values: dict[str, float] = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition("=")
            if key not in fields or not re.fullmatch(r"\d+(\.\d+)?", value):
                raise ValueError(f"a link shape is loss=PCT,rate=MBIT,delay=MS,jitter=MS; got {part!r}")
            values[fields[key]] = float(value)
        return cls(**values)

    def __str__(self) -> str:
        parts = [f"{self.loss_pct:g}% loss"] if self.loss_pct else []
        if self.rate_mbit:
            parts.append(f"{self.rate_mbit:g} Mbit/s")
        if self.delay_ms:
            parts.append(f"{self.delay_ms:g}±{self.jitter_ms:g} ms")
        return ", ".join(parts) or "clean"


@cache
def delay_unavailable() -> str | None:
    """Why packets cannot be delayed here (one line), or None when netem works."""
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2 is not installed)"
    probe = "kvmb-netem-probe"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    try:
        done = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        return None if done.returncode == 0 else f"this kernel cannot delay packets (netem: {done.stderr.strip()})"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=COMMAND_TIMEOUT_S)


def loss_unavailable() -> str | None:
    return None if shutil.which("nft") else "no `nft` command (install the nftables package)"


def shape(host: Host, link: LinkShape) -> None:
    """Gives `host`'s link this shape, in place of any it had."""
    unshape(host)
    if link.loss_pct:
        if (why := loss_unavailable()) is not None:
            raise BedError(why)
        per_10k = str(round(link.loss_pct * 100))
        host.run("nft", "add", "table", "inet", TABLE)
        for chain, hook, match in (("in", "input", "iifname"), ("out", "output", "oifname")):
            host.run("nft", "add", "chain", "inet", TABLE, chain, f"{{ type filter hook {hook} priority 0; }}")
            host.run("nft", "add", "rule", "inet", TABLE, chain, match, "eth0", "numgen", "random", "mod", "10000",
                     "<", per_10k, "drop")
    if link.delay_ms and (why := delay_unavailable()) is not None:
        raise BedError(why)
    for qdisc in _qdiscs(link):
        host.run("tc", "qdisc", "add", "dev", "eth0", "root", *qdisc)
        _run("tc", "qdisc", "add", "dev", host.outside, "root", *qdisc)


def unshape(host: Host) -> None:
    """Takes every shape off `host`'s link (what is not there is not an error)."""
    for argv in (host.argv("nft", "delete", "table", "inet", TABLE), host.argv("tc", "qdisc", "del", "dev", "eth0", "root"),
                 ["tc", "qdisc", "del", "dev", host.outside, "root"]):
        subprocess.run(argv, capture_output=True, timeout=COMMAND_TIMEOUT_S)


def _qdiscs(link: LinkShape) -> list[list[str]]:
    """One root qdisc per end: netem carries the rate too when both are asked for."""
    if link.delay_ms:
        netem = ["netem", "delay", f"{link.delay_ms:g}ms", f"{link.jitter_ms:g}ms"]
        return [netem + (["rate", f"{link.rate_mbit:g}mbit"] if link.rate_mbit else [])]
    if link.rate_mbit:
        return [["tbf", "rate", f"{link.rate_mbit:g}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY]]
    return []


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {done.stderr.strip()}")
