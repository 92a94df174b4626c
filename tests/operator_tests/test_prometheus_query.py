"""``prometheus.instant_value`` against a real HTTP server on loopback speaking Prometheus'
query API: one sample is its value; no sample, several, an error answer or no server is None."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from quire_operator.observed.prometheus import instant_value

ANSWERS = {
    "one": {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [1.0, "3"]}]}},
    "none": {"status": "success", "data": {"resultType": "vector", "result": []}},
    "two": {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"a": "1"}, "value": [1.0, "1"]}, {"metric": {"a": "2"}, "value": [1.0, "2"]}]}},
    "nan": {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [1.0, "NaN"]}]}},
}  # fmt: skip


class _Prometheus(BaseHTTPRequestHandler):
    queries: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)["query"][0]
        self.queries.append(query)
        if url.path != "/api/v1/query" or query not in ANSWERS:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"status": "error", "error": "parse error"}')
            return
        body = json.dumps(ANSWERS[query]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def address() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_one_sample_is_its_value_and_anything_else_is_unknown(address: str) -> None:
    assert instant_value(address, "one") == 3.0
    assert instant_value(address, "none") is None
    assert instant_value(address, "two") is None
    assert instant_value(address, "nan") is None
    assert instant_value(address, 'sum(x{a="b"})') is None  # refused (400)
    assert _Prometheus.queries[-1] == 'sum(x{a="b"})'  # sent intact, URL-encoded


def test_no_server_is_unknown_not_an_error() -> None:
    assert instant_value("http://127.0.0.1:9", "one", timeout=1.0) is None
