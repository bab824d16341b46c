"""A small network of Linux network namespaces for tests of servers behind a NAT (needs root and `ip netns`).

    home (a server behind a router) ---- relay ---- outside (clients, public servers)
         10.213.1.2                   10.213.0.1        10.213.2.2

The relay namespace is the router between them, except that it forwards nothing (net.ipv4.ip_forward=0): home
and outside reach its public address 10.213.0.1 (the relays listen there), never each other. Home has no route
to outside's network nor outside to home's: nothing crosses but through a libp2p relay. The names carry the
test's process id, so concurrent runs never meet; `remove` deletes what `create` made, even half of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

RELAY_ADDRESS = "10.213.0.1"
HOME_ADDRESS, HOME_GATEWAY = "10.213.1.2", "10.213.1.1"
OUTSIDE_ADDRESS, OUTSIDE_GATEWAY = "10.213.2.2", "10.213.2.1"


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


@dataclass
class Network:
    home: str
    relay: str
    outside: str
    pid: int

    @classmethod
    def create(cls) -> "Network":
        """The three namespaces, linked; NetnsUnavailable (what to skip with) where this machine cannot."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        pid = os.getpid()
        network = cls(f"swh{pid}", f"swr{pid}", f"swo{pid}", pid)
        try:
            network._build()
        except BaseException:
            network.remove()
            raise
        return network

    def _build(self) -> None:
        for name in (self.home, self.relay, self.outside):
            _ip("netns", "add", name)
            self.run_ip(name, "link", "set", "lo", "up")
        # the relay's public address, on its loopback: reached from either side, routed by neither
        self.run_ip(self.relay, "addr", "add", f"{RELAY_ADDRESS}/32", "dev", "lo")
        self.exec(self.relay, "sysctl", "-qw", "net.ipv4.ip_forward=0")
        for side, tag, address, gateway in ((self.home, "h", HOME_ADDRESS, HOME_GATEWAY),
                                            (self.outside, "o", OUTSIDE_ADDRESS, OUTSIDE_GATEWAY)):
            near, far = f"v{tag}{self.pid}", f"v{tag}r{self.pid}"  # at most 15 characters: a Linux interface name
            _ip("link", "add", near, "type", "veth", "peer", "name", far)
            _ip("link", "set", near, "netns", side)
            _ip("link", "set", far, "netns", self.relay)
            self.run_ip(side, "addr", "add", f"{address}/24", "dev", near)
            self.run_ip(self.relay, "addr", "add", f"{gateway}/24", "dev", far)
            self.run_ip(side, "link", "set", near, "up")
            self.run_ip(self.relay, "link", "set", far, "up")
            self.run_ip(side, "route", "add", f"{RELAY_ADDRESS}/32", "via", gateway)

    def run_ip(self, namespace: str, *args: str) -> None:
        _ip("-n", namespace, *args)

    def exec(self, namespace: str, *command: str) -> None:
        _ip("netns", "exec", namespace, *command)

    def prefix(self, namespace: str) -> list[str]:
        """The command prefix that runs a process in `namespace`."""
        return ["ip", "netns", "exec", namespace]

    def remove(self) -> None:
        """Delete the namespaces (the links in them go with them) and any link not moved into one yet; what is
        already gone is fine."""
        for name in (self.home, self.relay, self.outside):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)
        for link in (f"vh{self.pid}", f"vo{self.pid}"):
            subprocess.run(["ip", "link", "delete", link], capture_output=True, timeout=10)
