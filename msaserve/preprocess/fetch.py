"""Turn a media URL into bytes: `data:` always; `file://` and `http(s)://` only when allowed.

http(s) fetches are guarded against SSRF: the host must be on the allow-list (if one is set) and
every address it resolves to must be public unless private addresses are allowed. The request
connects to the address that was checked (no second DNS lookup a rebinding attack could change),
redirects are followed by hand so that every hop is checked again, and size and time are bounded
while streaming.
"""

import base64
import binascii
import ipaddress
import os
import socket
import time
import urllib.parse
from collections.abc import Callable

import httpx

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError

Resolver = Callable[[str, int], list[str]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_ASCII_WHITESPACE = str.maketrans("", "", " \t\n\f\r")


def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (getaddrinfo)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def decode_data_url(url: str, max_bytes: int, param: str | None = None) -> bytes:
    """Bytes of a `data:[<type>][;base64],<payload>` URL; the declared type is ignored."""
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError(400, "invalid_content_part", "data: URL has no ',' before its payload", param)
    if header.endswith(";base64"):
        # Refuse before decoding: base64 is 4 characters per 3 bytes (whitespace included: an
        # upper bound, so nothing is copied before the payload is known to be small enough).
        if len(payload) * 3 // 4 > max_bytes + 2:
            raise _too_large(len(payload) * 3 // 4, max_bytes, param)
        # Line breaks and spaces are dropped, as browsers do (WHATWG forgiving-base64): MIME
        # encoders (`base64.encodebytes`, `openssl base64`) wrap lines at 64 or 76 characters.
        payload = payload.translate(_ASCII_WHITESPACE)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(
                400,
                "invalid_content_part",
                f"data: URL payload is not valid base64 ({e}): allowed A-Z, a-z, 0-9, '+', '/' "
                "and '=' padding, in a length that is a multiple of 4",
                param,
            ) from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, param)
    return data


def _too_large(size: int, max_bytes: int, param: str | None) -> MediaError:
    return MediaError(413, "media_bytes_limit", f"medium is {size} bytes; limit is {max_bytes} bytes", param)


class Fetcher:
    """Fetch media bytes from a URL under `config`'s source rules. `resolver` and `transport` are
    injectable for tests (the default resolver is getaddrinfo)."""

    def __init__(
        self,
        config: PreprocessConfig,
        resolver: Resolver = system_resolver,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config
        self.resolver = resolver
        self.transport = transport
        self.exempt = [ipaddress.ip_network(n, strict=False) for n in config.allowed_private_networks]

    def fetch(self, url: str, max_bytes: int, param: str | None = None) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_data_url(url, max_bytes, param)
        if scheme == "file":
            return self._read_file(url, max_bytes, param)
        if scheme in ("http", "https"):
            if not self.config.allow_http_urls:
                raise _not_allowed(
                    "http(s) URLs are disabled (allow_http_urls=False); send a data: URL", param
                )
            return self._fetch_http(url, max_bytes, param)
        cfg = self.config
        allowed = ["data:"] + ["http(s):"] * cfg.allow_http_urls + ["file:"] * cfg.allow_file_urls
        raise MediaError(
            400,
            "invalid_content_part",
            f"unsupported URL scheme {scheme!r} (URL {_shown(url)}); allowed: {', '.join(allowed)}",
            param,
        )

    def _read_file(self, url: str, max_bytes: int, param: str | None) -> bytes:
        if not self.config.allow_file_urls:
            raise _not_allowed("file:// URLs are disabled (allow_file_urls=False)", param)
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise _not_allowed(f"file:// URL names a remote host {parsed.netloc!r}", param)
        path = os.path.realpath(urllib.parse.unquote(parsed.path))
        roots = [os.path.realpath(r) for r in self.config.file_roots]
        if roots and not any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots):
            raise _not_allowed(f"file path is outside file_roots={list(self.config.file_roots)}", param)
        try:
            size = os.path.getsize(path)
            if size > max_bytes:
                raise _too_large(size, max_bytes, param)
            with open(path, "rb") as f:
                return f.read(max_bytes + 1)
        except OSError as e:
            raise MediaError(400, "fetch_failed", f"cannot read file: {e.strerror}", param) from None

    def check_url(self, url: str, param: str | None = None) -> tuple[httpx.URL, str]:
        """Validate one hop; return the URL rewritten to the checked IP and the original host."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as e:
            raise MediaError(400, "invalid_content_part", f"invalid URL: {e}", param) from None
        if parsed.scheme not in ("http", "https"):
            raise _not_allowed(f"redirect to scheme {parsed.scheme!r} refused", param)
        host = parsed.host
        if not host:
            raise MediaError(400, "invalid_content_part", f"URL has no host: {url!r}", param)
        if self.config.allowed_hosts and not _host_allowed(host, self.config.allowed_hosts):
            raise _not_allowed(
                f"host {host!r} is not in allowed_hosts={list(self.config.allowed_hosts)}", param
            )
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            addresses = self.resolver(host, port)
        except OSError as e:
            raise MediaError(400, "fetch_failed", f"cannot resolve host {host!r}: {e}", param) from None
        if not addresses:
            raise MediaError(400, "fetch_failed", f"host {host!r} has no addresses", param)
        for address in addresses:
            self._check_address(host, ipaddress.ip_address(address.split("%")[0]), param)
        return parsed.copy_with(host=addresses[0]), host

    def _check_address(self, host: str, ip: IPAddress, param: str | None) -> None:
        if self.config.allow_private_addresses or any(ip in net for net in self.exempt):
            return
        mapped = getattr(ip, "ipv4_mapped", None)
        target = mapped or ip
        if not target.is_global or target.is_multicast or target.is_reserved:
            raise _not_allowed(
                f"host {host!r} resolves to non-public address {ip} (loopback, private, link-local, "
                "multicast or reserved); allow_private_addresses=False",
                param,
            )

    def _fetch_http(self, url: str, max_bytes: int, param: str | None) -> bytes:
        cfg = self.config
        deadline = time.monotonic() + cfg.fetch_timeout_s
        with httpx.Client(
            timeout=cfg.fetch_timeout_s, follow_redirects=False, transport=self.transport, trust_env=False
        ) as client:
            for _hop in range(cfg.max_redirects + 1):
                if time.monotonic() > deadline:  # the limit covers the whole redirect chain
                    raise _timeout(cfg.fetch_timeout_s, param)
                pinned, host = self.check_url(url, param)
                headers = {"Host": httpx.URL(url).netloc.decode("ascii"), "Accept": "image/*,video/*"}
                request = client.build_request(
                    "GET", pinned, headers=headers, extensions={"sni_hostname": host}
                )
                try:
                    response = client.send(request, stream=True)
                except httpx.TimeoutException:
                    raise _timeout(cfg.fetch_timeout_s, param) from None
                except httpx.HTTPError as e:
                    raise MediaError(400, "fetch_failed", f"fetching {host!r} failed: {e}", param) from None
                try:
                    if response.is_redirect:
                        url = str(httpx.URL(url).join(response.headers["location"]))
                        continue
                    if response.status_code != 200:
                        raise MediaError(
                            400, "fetch_failed", f"{host!r} answered HTTP {response.status_code}", param
                        )
                    return _read_body(response, max_bytes, deadline, cfg.fetch_timeout_s, param)
                finally:
                    response.close()
        raise MediaError(400, "fetch_failed", f"more than max_redirects={cfg.max_redirects} redirects", param)


def _read_body(
    response: httpx.Response, max_bytes: int, deadline: float, timeout_s: float, param: str | None
) -> bytes:
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes, param)
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes, param)
            if time.monotonic() > deadline:
                raise _timeout(timeout_s, param)
            chunks.append(chunk)
    except httpx.TimeoutException:
        raise _timeout(timeout_s, param) from None
    except httpx.HTTPError as e:
        raise MediaError(400, "fetch_failed", f"reading the response failed: {e}", param) from None
    return b"".join(chunks)


def _shown(url: str) -> str:
    """The URL as an error quotes it: its first 100 characters (a data: URL can be megabytes)."""
    return repr(url) if len(url) <= 100 else f"{url[:100]!r}… ({len(url):,} characters)"


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == a.lower() or (a.startswith(".") and host.endswith(a.lower())) for a in allowed)


def _not_allowed(message: str, param: str | None) -> MediaError:
    return MediaError(403, "url_not_allowed", message, param)


def _timeout(timeout_s: float, param: str | None) -> MediaError:
    return MediaError(400, "fetch_timeout", f"fetch exceeded fetch_timeout_s={timeout_s}", param)
