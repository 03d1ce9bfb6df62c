"""The local pool's channel to its own worker: framing, limits, and what reaches the envs."""

from __future__ import annotations

import os
import resource
import signal
import socket
import struct
import textwrap
import threading
import time

import psutil
import pytest

from boltzlabs_gym import RLPool, WorkerError
from boltzlabs_gym.wire.channel import Channel, ChannelClosed, ChannelError, WorkerChannel
from boltzlabs_gym.worker.sandbox.base import CONTROL_FD
from conftest import COUNTER, ISOLATION

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    client, worker = Channel(a), WorkerChannel(b)
    yield client, worker
    client.close()
    worker.close()


def _read_all(worker: WorkerChannel, count: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(worker.read_messages())
        time.sleep(0.001)
    return got


def test_messages_keep_their_frames_and_order(pair):
    client, worker = pair
    sent = [[b"h%d" % i, b"", bytes(range(i % 256)) * 3] for i in range(200)]
    got = []
    for message in sent:
        client.send_multipart(message)
        got.extend(worker.read_messages())
    assert got + _read_all(worker, len(sent) - len(got)) == sent
    worker.send_multipart([b"reply", memoryview(b"view")])
    assert client.poll(1000) and client.recv_multipart() == [b"reply", b"view"]
    assert not client.poll(10)


def test_a_reply_larger_than_the_socket_buffer_arrives_whole(pair):
    """The worker never blocks: what the socket cannot take now is queued and flushed later."""
    client, worker = pair
    big = os.urandom(32 << 20)
    worker.send_multipart([b"header", big])
    assert worker.wants_write  # far more than a socketpair buffers
    received = []
    reader = threading.Thread(target=lambda: received.append(client.recv_multipart()))
    reader.start()
    deadline = time.monotonic() + 30
    while worker.wants_write and time.monotonic() < deadline:
        worker.flush()
        time.sleep(0.001)
    reader.join(30)
    assert received == [[b"header", big]]


class _ChunkedStream:
    """A byte stream served to ``recv_into`` in the chunk sizes a socket might give."""

    def __init__(self, data: bytes, sizes):
        self.data, self.pos, self.sizes = data, 0, sizes

    def recv_into(self, buf) -> int:
        n = min(len(buf), next(self.sizes), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


@pytest.mark.parametrize("chunk", [1000, 65536, 1 << 20])
def test_large_messages_between_small_ones_arrive_whole_and_in_order(chunk):
    """A large message is received in place (its frames views of one buffer); what follows
    it in the stream, small or large, is untouched, whatever the chunking."""
    import itertools

    from boltzlabs_gym.wire.channel import LARGE_MESSAGE_BYTES, _buffers, _Reader

    sent = []
    for i in range(6):
        size = LARGE_MESSAGE_BYTES + 12345 * i if i % 2 else 100 + i
        sent.append([b"h%d" % i, os.urandom(size), b"", os.urandom(7)])
    stream = b"".join(bytes(b) for m in sent for b in _buffers(m))
    source = _ChunkedStream(stream, itertools.cycle([chunk, chunk // 3 + 1, 7]))
    reader, received = _Reader(large_in_place=True), []
    while source.pos < len(stream):
        reader.fill(source)
        while (message := reader.take()) is not None:
            received.append(message)
    assert [[bytes(f) for f in m] for m in received] == sent
    assert all(type(m[0]) is bytes for m in received), "headers stay bytes"
    if chunk < LARGE_MESSAGE_BYTES:  # else it came whole in one chunk: nothing to gain in place
        assert type(received[1][1]) is memoryview, "an incomplete large message is received in place"
    assert type(received[0][1]) is bytes


def test_a_request_larger_than_the_socket_buffer_arrives_whole(pair):
    client, worker = pair
    big = os.urandom(16 << 20)
    sender = threading.Thread(target=client.send_multipart, args=([b"upload", big],))
    sender.start()
    got = _read_all(worker, 1, timeout=30)
    sender.join(30)
    assert got == [[b"upload", big]]


@pytest.mark.parametrize(
    "raw, message",
    [
        (struct.pack("<I", 0), "announces 0 frames"),
        (struct.pack("<I", 1 << 20), "frames (1.."),
        (struct.pack("<IQ", 1, 1 << 40), "over the limit"),
    ],
)
def test_a_corrupt_stream_is_an_error_not_a_hang(pair, raw, message):
    client, worker = pair
    client._sock.sendall(raw)
    with pytest.raises(ChannelError, match=message.replace("(", r"\(").replace(".", r"\.")):
        _read_all(worker, 1, timeout=2)


def test_either_end_closing_is_seen(pair):
    client, worker = pair
    worker.close()
    with pytest.raises(ChannelClosed):
        for _ in range(100):  # the first sends may still fit in the buffer
            client.send_multipart([b"x" * 65536])
    with pytest.raises(ChannelClosed):
        client.poll(1000)


def test_a_local_pool_reaches_its_worker_over_the_channel():
    with RLPool(COUNTER, n=2, isolation=ISOLATION) as pool:
        link = pool._links[0]
        assert isinstance(link.sock, Channel)
        obs = pool.reset(seed=0)
        assert obs == [{"t": 0}, {"t": 0}]
        obs, rewards, dones, infos = pool.step([1, 2])
        assert [o["t"] for o in obs] == [1, 1] and list(rewards) == [1.0, 2.0]


def test_envs_cannot_reach_the_channel(tmp_path):
    """The channel is the trainer's: no env process may hold it (it could talk to the worker)."""
    (tmp_path / "env.py").write_text(textwrap.dedent("""
        import os
        from boltzlabs_gym.env import serve

        def fds():
            out = []
            for fd in sorted(int(x) for x in os.listdir("/proc/self/fd")):
                try:
                    out.append([fd, os.readlink(f"/proc/self/fd/{fd}")])
                except OSError:
                    pass
            return out

        serve(reset=lambda seed: fds(), step=lambda action: (fds(), 0.0, False, {}))
    """))
    with RLPool(str(tmp_path), n=1, isolation=ISOLATION) as pool:
        fds = pool.reset(seed=0)[0]
        # Neither the channel nor the worker's ZeroMQ sockets: an env inherits no socket, but for its
        # own control socket where it can take memory snapshots (a socketpair with the worker, which
        # reads it only during a snapshot and knows who speaks on it: see worker/cowfork.py)
        sockets = [fd for fd, target in fds if target.startswith("socket:")]
        memory = pool.isolation.backend == "namespaces" and os.geteuid() == 0
        assert sockets == ([CONTROL_FD] if memory else []), fds
        assert {0, 1, 2} <= {fd for fd, _ in fds}


def test_the_worker_exits_when_its_pool_is_killed(tmp_path):
    """The channel's end of stream tells the worker its pool is gone, even without a signal."""
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from boltzlabs_gym import RLPool
        pool = RLPool({COUNTER!r}, n=2, isolation={ISOLATION!r})
        print(pool._links[0].process.pid, flush=True)
        time.sleep(600)
    """))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(trainer.stdout.readline()))  # taken while it surely runs
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        assert psutil.wait_procs([worker], timeout=20)[1] == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.stdout.close()


def test_a_dead_local_worker_is_a_clear_error():
    pool = RLPool(COUNTER, n=1, isolation=ISOLATION)
    try:
        pool._links[0].process.kill()
        pool._links[0].process.wait(10)
        with pytest.raises(WorkerError, match="local worker"):
            pool.step([1])
    finally:
        pool.close()


def test_descriptors_ride_with_their_message_in_order(pair):
    client, worker = pair
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 10_000:
        pytest.skip(f"needs 10,000 descriptors, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < 10_000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (10_000, hard))
    # More than one sendmsg can carry (the kernel's limit is 253 per message), and messages
    # without descriptors around them.
    pipes = [os.pipe() for _ in range(300)]
    sent = [fd for pipe in pipes for fd in pipe]
    worker.send_multipart([b"before"])
    worker.send_multipart([b"with fds", b"x" * 100_000], sent)
    worker.send_multipart([b"after"], sent[:3])
    worker.send_multipart([b"tiny"], (sent * 6)[: 12 * 250 + 1])  # 13 carriers: past the 12-byte framing prefix
    got = []
    while len(got) < 4:
        worker.flush()
        if client.poll(100):
            got.append(client.recv_multipart())
    assert [m[0] for m in got] == [b"before", b"with fds", b"after", b"tiny"] and bytes(got[1][1]) == b"x" * 100_000
    mine = client.take_fds(len(sent))
    again = client.take_fds(3)
    for fd in client.take_fds(12 * 250 + 1):
        os.close(fd)
    with pytest.raises(ChannelError, match="claims 1 file descriptors but 0 arrived"):
        client.take_fds(1)
    # Duplicates of the sender's, in order, close-on-exec; the sender's own stay open.
    for theirs, ours in zip(sent + sent[:3], mine + again):
        assert ours != theirs and os.path.sameopenfile(theirs, ours)
        assert not os.get_inheritable(ours)
    os.write(mine[1], b"ping")  # our copy of the first pipe's write end
    assert os.read(pipes[0][0], 4) == b"ping"
    for fd in mine + again + sent:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_descriptors_of_an_unsent_message_are_closed_with_the_channel():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    worker = WorkerChannel(a)
    r, w = os.pipe()
    worker.send_multipart([b"big" * 500_000])  # fills the socket: the next message waits
    worker.send_multipart([b"with fds"], [r, w])
    before = len(os.listdir("/proc/self/fd"))
    worker.close()
    b.close()
    assert len(os.listdir("/proc/self/fd")) == before - 4  # both sockets and the two queued duplicates
    os.close(r)
    os.close(w)
