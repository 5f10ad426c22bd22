"""The TCP stream a donor and its newcomer share: the healing wire format runs over it exactly."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tests.unit.worker.test_healing import _assert_same, _real_state
from unbroken.worker import healing
from unbroken.worker.stream_link import LinkBroken, StreamLink


def _pair() -> tuple[StreamLink, StreamLink]:
    a, b = socket.socketpair()
    return StreamLink(a), StreamLink(b)


def test_a_real_state_and_tensors_of_every_dtype_cross_the_stream_exactly():
    left, right = _pair()
    state = _real_state()
    extra = [torch.randn(5, 7).to(torch.bfloat16), torch.arange(6).reshape(2, 3).t(), torch.empty(0), torch.rand(3) > 0.5]
    done = {}

    def send():
        done["sent"] = healing.send_state(left, state, 1)
        for t in extra:
            left.send(t, tag=7)

    thread = threading.Thread(target=send)
    thread.start()
    back, received = healing.recv_state(right, 0)
    got = [torch.empty(t.shape, dtype=t.dtype) for t in extra]
    for g in got:
        right.recv(g, tag=7)
    thread.join(10)
    _assert_same(back, state)
    assert received == done["sent"] and all(torch.equal(g, t) for g, t in zip(got, extra))
    left.close(), right.close()


def test_a_message_of_another_tag_or_size_or_a_closed_stream_is_a_clear_error():
    left, right = _pair()
    left.send(torch.ones(3), tag=1)
    with pytest.raises(LinkBroken, match="expected tag 2"):
        right.recv(torch.ones(3), tag=2, what="a record")
    left, right = _pair()
    left.send(torch.ones(4), tag=1)
    with pytest.raises(LinkBroken, match="16 bytes"):
        right.recv(torch.ones(3), tag=1, what="a record")
    left, right = _pair()
    left.close()
    with pytest.raises(LinkBroken, match="ended|reset|closed|Bad file"):
        right.recv(torch.ones(3), tag=1, what="a record")
