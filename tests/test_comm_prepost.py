"""The transport keeps PREPOSTED receives posted ahead for every peer (comm.py: gloo moves a message only once its
receiver has asked for it), matches them in the sender's order, and still refuses a round's mistakes."""
from __future__ import annotations

import pytest
import torch

from vgraph.backends.torch.distributed.runtime import comm
from vgraph.backends.torch.distributed.runtime.comm import PREPOSTED, Transport, TransportError


class FakeWire:
    """dist.irecv/isend on one process: a receive is posted (recorded) and filled, in posting order per peer,
    from what the test says each peer sent."""

    def __init__(self, sent: dict[int, list[float]]) -> None:
        self.sent = {src: list(values) for src, values in sent.items()}
        self.posted: list[int] = []  # sources, in posting order
        self.waited = 0

    def irecv(self, tensor: torch.Tensor, src: int, group=None):
        self.posted.append(src)
        value = self.sent[src].pop(0)
        wire = self

        class Work:
            def wait(self) -> None:
                wire.waited += 1
                tensor.fill_(value)

        return Work()


def _expect(n: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(f"m{i}", (2,), torch.float32) for i in range(n)]


@pytest.fixture(params=["gloo"])
def wire(request, monkeypatch):
    fake = FakeWire({0: [10.0, 11.0, 12.0, 13.0], 2: [20.0]})
    monkeypatch.setattr(comm.dist, "irecv", fake.irecv)
    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: request.param)
    return fake


@pytest.mark.parametrize("wire", ["nccl"], indirect=True)
def test_over_nccl_a_receive_is_posted_only_when_needed(wire) -> None:
    """nccl runs a pair's sends and receives in order on one stream: two peers receiving ahead would deadlock."""
    t = Transport(torch.device("cpu"))
    t.begin({0: _expect(4), 2: _expect(1)})
    assert wire.posted == []
    assert t.recv(0, "m1")[0].item() == 11.0  # m0 first, as sent: buffered
    assert wire.posted == [0, 0]
    assert t.recv(0, "m0")[0].item() == 10.0 and wire.posted == [0, 0]  # from the buffer: nothing posted
    assert [t.recv(0, k)[0].item() for k in ("m2", "m3")] == [12.0, 13.0]
    assert t.recv(2, "m0")[0].item() == 20.0
    assert wire.posted == [0, 0, 0, 0, 2]
    t.end()


def test_begin_posts_the_first_receives_of_every_peer_and_each_read_tops_them_up(wire) -> None:
    assert PREPOSTED >= 2  # one posted ahead of the message in flight: what the testbed needed (comm.py)
    t = Transport(torch.device("cpu"))
    t.begin({0: _expect(4), 2: _expect(1)})
    assert wire.posted == [0] * PREPOSTED + [2]  # before anything is asked for
    assert wire.waited == 0
    assert t.recv(0, "m0")[0].item() == 10.0
    assert wire.posted == [0] * PREPOSTED + [2, 0]  # one read, one more posted
    # Out of order: m3 first buffers m1 and m2 (the sender's order on the wire), then they come from the buffer.
    assert t.recv(0, "m3")[0].item() == 13.0
    assert wire.posted.count(0) == 4 and wire.waited == 4
    assert [t.recv(0, k)[0].item() for k in ("m2", "m1")] == [12.0, 11.0]
    assert t.recv(2, "m0")[0].item() == 20.0
    t.end()


def test_a_round_with_messages_left_unread_is_refused(wire) -> None:
    t = Transport(torch.device("cpu"))
    t.begin({0: _expect(3)})
    t.recv(0, "m0")
    with pytest.raises(TransportError, match="unread: \\['m1', 'm2'\\]"):
        t.end()


def test_a_message_the_peer_does_not_send_is_refused(wire) -> None:
    t = Transport(torch.device("cpu"))
    t.begin({0: _expect(1)})
    with pytest.raises(TransportError, match="sends no m7"):
        t.recv(0, "m7")
    with pytest.raises(TransportError, match="no messages from rank 5"):
        t.recv(5, "m0")


def test_a_peer_with_fewer_messages_than_the_window_gets_only_those(wire) -> None:
    t = Transport(torch.device("cpu"))
    t.begin({2: _expect(1), 0: []})
    assert wire.posted == [2]
    assert t.recv(2, "m0")[0].item() == 20.0
    t.end()
