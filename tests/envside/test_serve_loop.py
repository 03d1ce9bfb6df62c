"""The env side's one request loop (envside/serve_loop.py), run on a thread over two real pipes."""

from __future__ import annotations

import io
import os
import threading

import pytest

from boltzlabs_gym.envside.framing import FdReader, FdWriter, read_message, write_message
from boltzlabs_gym.envside.sandbox_slots import SandboxRequest
from boltzlabs_gym.envside.serve_loop import Ending, serve_requests, serve_sandbox_requests

pytestmark = pytest.mark.timeout(60)


class Loop:
    """``serve`` (a loop function taking a reader and a writer) on a thread, between two pipes."""

    def __init__(self, serve, *args, **kwargs):
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.reader, self.writer = FdReader(req_r), FdWriter(rep_w)
        self.replies = FdReader(self.rep_r)
        self.fds = [req_r, rep_w, self.rep_r]
        self.ending: Ending | None = None

        def run():
            self.ending = serve(self.reader, self.writer, *args, **kwargs)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def send(self, data: bytes) -> None:
        os.write(self.req_w, data)

    def reply(self) -> dict:
        got = read_message(self.replies)
        assert got is not None, "the loop wrote no reply"
        return got[0]

    def ended(self) -> Ending | None:
        """How the loop ended (after closing the request pipe, which ends any loop still serving)."""
        if self.req_w >= 0:
            os.close(self.req_w)
            self.req_w = -1
        self.thread.join(10)
        assert not self.thread.is_alive(), "the loop must end at end of input"
        return self.ending

    def unread(self) -> bytes:
        """What the loop wrote that no reply() read (once it ended: its end of the reply pipe is closed)."""
        assert self.ended() is not None
        os.close(self.fds.pop(1))
        rest = bytes(self.replies.buf)
        while chunk := os.read(self.rep_r, 1 << 16):
            rest += chunk
        return rest

    def close(self) -> None:
        self.ended()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def loops():
    made: list[Loop] = []
    yield lambda *args, **kwargs: made.append(Loop(*args, **kwargs)) or made[-1]
    for loop in made:
        loop.close()


def echo(loop_writer_of):
    """An answer that echoes each request with its payloads, and ends after ``{"op": "close"}``."""
    seen = []

    def answer(msg, payloads):
        seen.append((msg, payloads))
        write_message(loop_writer_of(), {"echo": msg, "sizes": [len(p) for p in payloads]})
        return msg.get("op") != "close"

    return answer, seen


def test_answers_requests_in_order_until_the_answer_says_it_was_the_last(loops):
    holder: list[Loop] = []
    answer, seen = echo(lambda: holder[0].writer)
    loop = loops(serve_requests, answer)
    holder.append(loop)
    loop.send(b'{"op":"step","action":1}\n{"op":"step","_bin":[3,0]}\nabc')
    assert loop.reply() == {"echo": {"op": "step", "action": 1}, "sizes": []}
    assert loop.reply() == {"echo": {"op": "step", "_bin": [3, 0]}, "sizes": [3, 0]}
    assert seen[1][1] == [b"abc", b""]
    loop.send(b'{"op":"close"}\n{"op":"step"}\n')
    assert loop.reply()["echo"] == {"op": "close"}
    assert loop.ended() is Ending.CLOSED
    assert len(seen) == 3 and loop.unread() == b"", "nothing after the last request is answered"


def test_end_of_input_ends_the_loop_quietly(loops):
    loop = loops(serve_requests, lambda msg, payloads: True)
    assert loop.ended() is Ending.END_OF_INPUT
    assert loop.unread() == b""


@pytest.mark.parametrize("serve_past", [False, True])
@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n"])
def test_a_line_read_whole_but_no_request_is_answered_and_served_past_only_when_asked(loops, serve_past, line):
    loop = loops(serve_requests, lambda msg, payloads: True, serve_past_bad_lines=serve_past)
    loop.send(line)
    assert loop.reply()["error"].startswith("bad request: ")
    loop.send(b'{"op":"step"}\n')
    if serve_past:
        assert loop.ended() is Ending.END_OF_INPUT
    else:
        assert loop.ended() is Ending.TORN
    assert loop.unread() == b"", "the error is the only reply"


@pytest.mark.parametrize(
    "torn",
    [b'{"op":"step","_bin":[5]}\nabc', b'{"op":"step","_bin":"x"}\n', b'{"op":"st'],
    ids=["truncated payload", "bad _bin", "half a line"],
)
def test_a_torn_stream_is_answered_and_ends_the_loop_even_when_serving_past_bad_lines(loops, torn):
    loop = loops(serve_requests, lambda msg, payloads: True, serve_past_bad_lines=True)
    loop.send(torn)
    os.close(loop.req_w)  # the rest never comes
    loop.req_w = -1
    assert loop.reply()["error"].startswith("bad request: ")
    assert loop.ended() is Ending.TORN


def test_quick_gets_each_lone_read_first_and_hands_back_what_it_does_not_answer(loops):
    holder: list[Loop] = []
    answer, seen = echo(lambda: holder[0].writer)
    offered = []

    def quick(data: bytes) -> bool:
        offered.append(data)
        if data == b"QUICK\n":
            write_message(holder[0].writer, {"quick": True})
            return True
        return False

    loop = loops(serve_requests, answer, quick=quick)
    holder.append(loop)
    loop.send(b"QUICK\n")
    assert loop.reply() == {"quick": True}
    loop.send(b'{"op":"step"}\n')
    assert loop.reply()["echo"] == {"op": "step"}
    # Two requests in one read: quick sees both bytes once, then both are answered in order
    # without quick (the buffer is not empty after the first).
    loop.send(b'{"op":"a"}\n{"op":"b"}\n')
    assert [loop.reply()["echo"]["op"] for _ in range(2)] == ["a", "b"]
    assert offered == [b"QUICK\n", b'{"op":"step"}\n', b'{"op":"a"}\n{"op":"b"}\n']
    assert loop.ended() is Ending.END_OF_INPUT
    assert [msg["op"] for msg, _ in seen] == ["step", "a", "b"]


def test_quick_needs_a_reader_of_the_fd_itself():
    with pytest.raises(TypeError, match="must be an FdReader"):
        serve_requests(io.BytesIO(b""), io.BytesIO(), lambda msg, payloads: True, quick=lambda data: False)


def test_sandbox_requests_are_checked_before_they_are_served(loops):
    holder: list[Loop] = []
    served: list[SandboxRequest] = []

    def answer_sandbox(request: SandboxRequest) -> bool:
        served.append(request)
        write_message(holder[0].writer, {"served": request.slots})
        return {"op": "close"} not in request.ops

    loop = loops(serve_sandbox_requests, 2, answer_sandbox)
    holder.append(loop)
    loop.send(b'{"op":"step","action":1}\n')  # not a sandbox request: answered, and the loop serves on
    assert loop.reply()["error"].startswith("bad group request: not a group request (this process hosts 2 envs)")
    loop.send(b'{"slots":[0,2],"ops":[1,1]}\n')
    assert "group slots must be ints in [0, 2)" in loop.reply()["error"]
    loop.send(b'{"slots":[1,0],"ops":[1,{"op":"reset"}],"autoreset":true,"nbin":[0,1],"_bin":[2]}\nxy')
    assert loop.reply() == {"served": [1, 0]}
    assert served == [SandboxRequest([1, 0], [1, {"op": "reset"}], [[], [b"xy"]], True)]
    loop.send(b'{"slots":[0],"ops":[{"op":"close"}]}\n')
    assert loop.reply() == {"served": [0]}
    assert loop.ended() is Ending.CLOSED
