"""URL sources and the SSRF guard, against a real HTTP server on 127.0.0.1 (no traffic leaves
this machine: addresses like 10.0.0.1 and 169.254.169.254 are refused before any connection)."""

import http.server
import socket
import threading
import time

import pytest
from preprocess_media import make_image

from msaserve.preprocess.config import PreprocessConfig
from msaserve.preprocess.errors import MediaError
from msaserve.preprocess.fetch import Fetcher

PNG = make_image(56, 56, "PNG")


HITS: list[tuple[str, str]] = []  # (path, Host header) of every request the server answered


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        HITS.append((self.path, self.headers.get("Host", "")))
        port = self.server.server_address[1]
        redirects = {
            "/redirect-ok": "/image.png",
            "/redirect-loopback": f"http://127.0.0.2:{port}/image.png",
            "/redirect-localhost": f"http://localhost:{port}/image.png",
            "/redirect-file": "file:///etc/passwd",
            "/loop": "/loop",
        }
        if self.path in redirects:
            self.send_response(302)
            self.send_header("Location", redirects[self.path])
            self.end_headers()
        elif self.path == "/image.png":
            self._send(PNG)
        elif self.path == "/big-declared":
            self._send(b"\0" * 10_000)
        elif self.path == "/big-chunked":
            self.send_response(200)
            self.end_headers()  # no Content-Length: the body runs until the connection closes
            for _ in range(10):
                self.wfile.write(b"\0" * 1000)
        elif self.path == "/slow":
            time.sleep(1.5)
            self._send(PNG)
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # clients that give up (size and time limits) close early: broken pipes are expected


@pytest.fixture(scope="module")
def server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture(autouse=True)
def clear_hits():
    HITS.clear()


def fetcher(**overrides) -> Fetcher:
    return Fetcher(PreprocessConfig(allow_http_urls=True, fetch_timeout_s=5.0, **overrides))


def refused(fetch: Fetcher, url: str) -> MediaError:
    with pytest.raises(MediaError) as error:
        fetch.fetch(url, 1 << 20, "content[0].image_url")
    return error.value


def test_loopback_refused_without_a_request(server):
    error = refused(fetcher(), f"{server}/image.png")
    assert (error.status, error.code) == (403, "url_not_allowed")
    assert "127.0.0.1" in error.message and "allow_private_addresses=False" in error.message
    assert HITS == []


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/x.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://192.168.1.1/x.png",
        "http://[::1]/x.png",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://0.0.0.0/x.png",
        "http://224.0.0.1/x.png",
        "http://localhost/x.png",
    ],
)
def test_private_link_local_and_special_addresses_refused(url):
    error = refused(fetcher(), url)
    assert (error.status, error.code) == (403, "url_not_allowed")


def test_allowed_when_private_addresses_allowed(server):
    assert fetcher(allow_private_addresses=True).fetch(f"{server}/image.png", 1 << 20) == PNG
    assert HITS[0][0] == "/image.png"


def test_every_redirect_hop_is_checked(server):
    # 127.0.0.1 is exempt, 127.0.0.2 (also loopback) is not: the redirect's target is refused.
    fetch = fetcher(allowed_private_networks=("127.0.0.1/32",))
    assert fetch.fetch(f"{server}/redirect-ok", 1 << 20) == PNG
    HITS.clear()
    error = refused(fetch, f"{server}/redirect-loopback")
    assert error.status == 403 and "127.0.0.2" in error.message
    assert [path for path, _ in HITS] == ["/redirect-loopback"]  # the target was never asked


def test_redirect_off_the_allow_list_refused(server):
    fetch = fetcher(allow_private_addresses=True, allowed_hosts=("127.0.0.1",))
    error = refused(fetch, f"{server}/redirect-localhost")
    assert error.status == 403 and "allowed_hosts=['127.0.0.1']" in error.message


def test_redirect_to_file_refused(server):
    error = refused(fetcher(allow_private_addresses=True), f"{server}/redirect-file")
    assert error.status == 403 and "'file'" in error.message


def test_redirect_limit(server):
    error = refused(fetcher(allow_private_addresses=True, max_redirects=3), f"{server}/loop")
    assert (error.status, error.code) == (400, "fetch_failed") and "max_redirects=3" in error.message
    assert len(HITS) == 4


@pytest.mark.parametrize("path", ["/big-declared", "/big-chunked"])
def test_size_limit_while_streaming(server, path):
    with pytest.raises(MediaError) as error:
        fetcher(allow_private_addresses=True).fetch(f"{server}{path}", 4096)
    assert (error.value.status, error.value.code) == (413, "media_bytes_limit")
    assert "limit is 4096 bytes" in error.value.message


def test_time_limit(server):
    fetch = Fetcher(PreprocessConfig(allow_http_urls=True, allow_private_addresses=True, fetch_timeout_s=0.3))
    error = refused(fetch, f"{server}/slow")
    assert (error.status, error.code) == (400, "fetch_timeout") and "fetch_timeout_s=0.3" in error.message


def test_upstream_error_is_a_4xx(server):
    error = refused(fetcher(allow_private_addresses=True), f"{server}/missing.png")
    assert (error.status, error.code) == (400, "fetch_failed") and "HTTP 404" in error.message


def test_connects_to_the_checked_address_with_the_original_host(server):
    """The resolver is asked once per hop and the connection goes to the address it returned
    (a DNS-rebinding answer between check and connect cannot redirect it)."""
    port = server.rsplit(":", 1)[1]
    answers = iter([["127.0.0.1"], ["10.0.0.1"]])  # a second lookup would get a private address
    config = PreprocessConfig(allow_http_urls=True, allowed_private_networks=("127.0.0.1/32",))
    fetch = Fetcher(config, resolver=lambda host, p: next(answers))
    assert fetch.fetch(f"http://media.test:{port}/image.png", 1 << 20) == PNG
    assert [("/image.png", f"media.test:{port}")] == HITS


def test_allow_list_suffix():
    fetch = fetcher(allowed_hosts=(".example.com",))
    assert "allowed_hosts" in refused(fetch, "http://evil.test/x.png").message
    assert "allowed_hosts" in refused(fetch, "http://example.com.evil.test/x.png").message


def no_dns(host: str, port: int) -> list[str]:
    raise socket.gaierror(-2, f"{host}: not resolved in tests (no traffic leaves the machine)")


@pytest.mark.parametrize("url", ["http://[bad/x.png", "http:///x.png", "https://exa mple.com/x.png"])
def test_malformed_urls_are_400(url):
    error = refused(Fetcher(PreprocessConfig(allow_http_urls=True), resolver=no_dns), url)
    assert error.status == 400 and error.code in ("invalid_content_part", "fetch_failed")
