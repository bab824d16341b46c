"""The addresses a block server announces (--public-address, --announce-maddrs) in place of those it listens on:
a box behind a forwarded port listens on a private address that no client can dial.

Each becomes one of p2pd's -announceAddrs (hivemind's announce_maddrs): the only addresses its libp2p host then
gives out (identify), so every peer that learns of the server, through the DHT or a connection, dials those.
"""

from __future__ import annotations

import ipaddress
import re

# a DNS name: dot-separated labels of letters, digits and inner hyphens (RFC 1123), not all digits
HOSTNAME = re.compile(r"(?=.*[a-z])([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*",
                      re.IGNORECASE)


class AddressError(ValueError):
    """A value of --public-address or --announce-maddrs that cannot be announced; the message names the flag."""


def public_maddr(text: str, listen_port: int) -> str:
    """--public-address HOST[:PORT] (an IPv6 host in brackets: [::1]:31337) as a multiaddr: /ip4/, /ip6/ or
    /dns4/ with /tcp/PORT; PORT defaults to the port the server listens on (--port), which then must be fixed:
    a forwarded port leads to a known one."""
    host, port = _split_host_port(text)
    if port is None:
        if not listen_port:
            raise AddressError(f"--public-address {text!r} has no port and --port is 0 (a random one): a forwarded "
                               "port must lead to a known port, so set --port, or give HOST:PORT")
        port = listen_port
    try:
        protocol = "ip4" if ipaddress.ip_address(host).version == 4 else "ip6"
    except ValueError:
        if len(host) > 253 or not HOSTNAME.fullmatch(host):
            raise AddressError(f"--public-address {text!r}: {host!r} is neither an IP address nor a host name")
        protocol = "dns4"
    return f"/{protocol}/{host}/tcp/{port}"


def _split_host_port(text: str) -> tuple[str, int | None]:
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", text)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a bare host, or a bare IPv6 address (no port: it would be ambiguous)
        host, port = text, None
    if not host:
        raise AddressError(f"--public-address {text!r} has no host")
    if port is None:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"--public-address {text!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def announce_maddr(text: str) -> str:
    """An --announce-maddrs value: a multiaddr of this server's own, with a TCP port (p2pd announces it as is;
    the peer id is added where the address is given out, so it must not carry one)."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        address = Multiaddr(text)
        protocols = [protocol.name for protocol in address.protocols()]
    except Exception as error:  # multiaddr raises several unrelated types for bad input
        raise AddressError(f"--announce-maddrs: malformed multiaddr {text!r}: {error}") from None
    if "p2p" in protocols or "ipfs" in protocols:
        raise AddressError(f"--announce-maddrs {text!r}: leave out the /p2p/ part, the server's peer id is added")
    if "tcp" not in protocols or not 0 < int(address.value_for_protocol("tcp")) < 65536:
        raise AddressError(f"--announce-maddrs {text!r}: the address needs a TCP port from 1 to 65535 "
                           "(/tcp/PORT)")
    return text
