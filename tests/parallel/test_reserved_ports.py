"""Reserved ports: taken from everyone but the server meant to bind them, and freed when the block ends."""

from __future__ import annotations

import datetime
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch.distributed as dist

from pipeline.parallel.rendezvous import BLOCK_PORTS, reserved_port, reserved_port_block


def _bindable(port: int) -> bool:
    """Whether a plain (exclusive) bind of ``port`` succeeds: what a probe or an unrelated server does."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_reserved_port_is_refused_to_others_until_the_block_ends() -> None:
    with reserved_port() as port:
        assert not _bindable(port)
        with reserved_port() as other:  # a second reservation never shares it
            assert other != port
    assert _bindable(port)


def test_the_rendezvous_store_and_an_http_server_bind_a_reserved_port() -> None:
    timeout = datetime.timedelta(seconds=10)
    for use_libuv in (True, False):
        with reserved_port() as port:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout, wait_for_workers=False,
                                  use_libuv=use_libuv)
            client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout, use_libuv=use_libuv)
            store.set("key", "value")
            assert client.get("key") == b"value"
            del client, store
    with reserved_port() as port:
        server = ThreadingHTTPServer(("127.0.0.1", port), _Ok)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
                assert response.status == 200
        finally:
            server.shutdown()
            server.server_close()


def test_a_port_block_is_consecutive_reserved_and_skips_a_taken_port() -> None:
    with reserved_port_block(4) as base:
        assert BLOCK_PORTS[0] <= base and base + 4 <= BLOCK_PORTS[1]
        assert not any(_bindable(base + i) for i in range(4))
        # A search that starts on the block (or on a port a server listens on) moves past it.
        with reserved_port_block(4, start=base) as other:
            assert not set(range(base, base + 4)) & set(range(other, other + 4))
        with socket.socket() as taken:
            taken.bind(("", base + 8))
            taken.listen()
            with reserved_port_block(4, start=base + 5) as third:
                assert base + 8 not in range(third, third + 4) and base + 3 not in range(third, third + 4)
    assert all(_bindable(base + i) for i in range(4))
    with pytest.raises(ValueError, match="count"):
        with reserved_port_block(0):
            pass
