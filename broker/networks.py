"""Address lists of the settings: networks, and ``loopback`` spelled out."""

from __future__ import annotations

import ipaddress

LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Networks from a comma-separated list of addresses, networks (``10.0.0.0/8``),
    ``loopback`` or ``none``; ValueError names the entry that is none of these."""
    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for entry in (e.strip() for e in text.split(",")):
        if entry.lower() == "none" or not entry:
            continue
        names = LOOPBACK_NETWORKS if entry.lower() == "loopback" else (entry,)
        networks.extend(ipaddress.ip_network(name, strict=False) for name in names)
    return tuple(networks)
