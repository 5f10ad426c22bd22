"""A launcher pointed at a coordinator checks that it answers, as one, before starting workers."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from unbroken.coordinator.membership import MembershipSettings
from unbroken.coordinator.server import Coordinator, CoordinatorSettings
from unbroken.errors import ConfigError
from unbroken.launch.coordinator_probe import probe


@pytest.fixture
def coordinator():
    c = Coordinator(CoordinatorSettings(hold=0.05, token="s3cret"), MembershipSettings(expected_members=1)).start_in_thread()
    try:
        yield c
    finally:
        c.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_coordinator_answers_and_a_wrong_token_is_named(coordinator):
    said = []
    assert probe(f"127.0.0.1:{coordinator.port}", "s3cret", said.append, patience=5)
    assert said == []
    with pytest.raises(ConfigError, match="refused this node's token"):
        probe(f"127.0.0.1:{coordinator.port}", "guess", said.append, patience=5)


def test_another_program_on_the_port_is_an_error_at_once():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=f"127.0.0.1:{server.server_port} answered, but not as an unbroken coordinator"):
            probe(f"127.0.0.1:{server.server_port}", None, print, patience=30)
        assert time.monotonic() - started < 10, "not retried for the patience"
    finally:
        server.shutdown()
        server.server_close()


def test_nothing_listening_is_retried_with_console_lines_then_an_error_naming_the_address(monkeypatch):
    monkeypatch.setattr("unbroken.launch.coordinator_probe.SAY_EVERY", 0.3)
    port, said = _free_port(), []
    with pytest.raises(ConfigError, match=rf"no coordinator answered at 127.0.0.1:{port} within 1 s .*connection refused"):
        probe(f"127.0.0.1:{port}", None, said.append, patience=1.0)
    assert said and all("waiting for the coordinator" in line for line in said)


def test_a_coordinator_that_starts_while_it_waits_is_found(coordinator):
    """Another node's launcher may start it a moment later: the candidate list's later entry answers."""
    port = _free_port()
    assert probe(f"127.0.0.1:{port},127.0.0.1:{coordinator.port}", "s3cret", print, patience=5)


def test_a_ctrl_c_while_it_waits_ends_the_wait():
    started = time.monotonic()
    assert not probe(f"127.0.0.1:{_free_port()}", None, print, patience=30, stopped=lambda: time.monotonic() - started > 0.5)
    assert time.monotonic() - started < 5
