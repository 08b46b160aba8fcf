"""Which address a request counts against (`http.max_requests_per_client`): the TCP peer, unless
the peer is a configured trusted proxy (`http.trusted_proxies`), and then the address that proxy
put in `X-Forwarded-For`.

A client can write any `X-Forwarded-For` it likes; only a proxy the operator named may vouch for
it. The header is read from the right (each proxy appends the address it saw): trusted proxies
are skipped, and the first address that is not one is the client. With no trusted proxies (the
default) the header is never read.

uvicorn (inside Serve's HTTP proxy) has its own rewrite of `scope["client"]` from the header,
`FORWARDED_ALLOW_IPS`, which trusts 127.0.0.1 by default: any local process could then pose as
any number of clients. `FORWARDED_ALLOW_IPS_ENV` is set to the same trusted list wherever
msaserve configures the proxy, so both agree.
"""

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

FORWARDED_ALLOW_IPS_ENV = "FORWARDED_ALLOW_IPS"
"""uvicorn's list of peers whose X-Forwarded-For it applies (read when the server is configured)."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """IP addresses or CIDR networks → networks; ValueError naming the entry otherwise."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"http.trusted_proxies entry {entry!r} is not an IP address or CIDR network "
                "(allowed: e.g. '10.0.0.0/8', '192.168.1.7', 'fd00::/8')"
            ) from None
    return tuple(networks)


@dataclass(frozen=True)
class ClientAddress:
    trusted: tuple[Network, ...] = ()

    @classmethod
    def from_entries(cls, entries: Iterable[str]) -> "ClientAddress":
        return cls(parse_networks(entries))

    def is_trusted(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.trusted)

    def of(self, peer: str, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """The client address of a request whose TCP peer is `peer`."""
        if not self.trusted or not self.is_trusted(peer):
            return peer
        forwarded = [v.decode("latin-1") for name, v in headers if name == b"x-forwarded-for"]
        hops = [h.strip() for h in ",".join(forwarded).split(",") if h.strip()]
        for hop in reversed(hops):
            host = _host_of(hop)
            if not self.is_trusted(host):
                return host
        return _host_of(hops[0]) if hops else peer


def _host_of(hop: str) -> str:
    """'1.2.3.4:5678' → '1.2.3.4', '[::1]:80' → '::1', a bare address unchanged."""
    if hop.startswith("[") and "]" in hop:
        return hop[1 : hop.index("]")]
    if hop.count(":") == 1:
        return hop.split(":", 1)[0]
    return hop
