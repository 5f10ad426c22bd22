"""A point-to-point TCP stream with the ``send``/``recv`` of a generation's group, so that the
healing wire format (:func:`unbroken.worker.healing.send_state`, ``recv_state``) runs over it
between two processes that share no generation: a member that donates its state and a newcomer
that catches up (:mod:`unbroken.worker.catch_up`).

Each message is a 16-byte frame (tag, bytes), then the tensor's bytes, written from and read into
the tensor's own memory. A receiver checks that the frame carries the tag and size it expects.
"""

from __future__ import annotations

import socket
import struct

import torch

from unbroken.errors import UnbrokenError

_FRAME = struct.Struct("!qq")


class LinkBroken(UnbrokenError):
    """The stream ended or carried something other than what was expected."""


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (bfloat16 included), without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class StreamLink:
    """One end of the stream; ``dst``/``src`` arguments are ignored (there is one peer)."""

    device = torch.device("cpu")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # not TCP (a Unix socket pair in the tests)
            pass

    def send(self, tensor: torch.Tensor, dst: int = 1, tag: int = 0, what: str = "") -> None:
        data = tensor.detach()
        if data.device.type != "cpu" or not data.is_contiguous():
            data = data.to("cpu").contiguous()
        view = _bytes_of(data)
        try:
            self.sock.sendall(_FRAME.pack(tag, view.nbytes))
            self.sock.sendall(view)
        except OSError as exc:
            raise LinkBroken(f"{what or 'a message'} could not be sent: {exc}") from None

    def recv(self, tensor: torch.Tensor, src: int = 0, tag: int = 0, what: str = "") -> None:
        tag_got, size = _FRAME.unpack(self._read(_FRAME.size, what))
        target = tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else torch.empty_like(tensor, device="cpu")
        view = _bytes_of(target)
        if tag_got != tag or size != view.nbytes:
            raise LinkBroken(f"{what}: got a message of tag {tag_got} and {size} bytes, expected tag {tag} and {view.nbytes}")
        self._read_into(view, what)
        if target is not tensor:
            tensor.copy_(target)

    def _read(self, count: int, what: str) -> bytes:
        buffer = bytearray(count)
        self._read_into(memoryview(buffer), what)
        return bytes(buffer)

    def _read_into(self, view: memoryview, what: str) -> None:
        got = 0
        while got < view.nbytes:
            try:
                n = self.sock.recv_into(view[got:], view.nbytes - got)
            except OSError as exc:
                raise LinkBroken(f"{what}: {exc}") from None
            if n == 0:
                raise LinkBroken(f"{what}: the stream ended")
            got += n

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
