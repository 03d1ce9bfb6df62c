"""Protocol fuzzing: malformed client messages, fuzzed env stdout, fuzzed lines into serve().

* A real worker process gets random, truncated, oversized, wrong-shape and out-of-order
  ZeroMQ messages. It must answer every one (an error with a kind and a message unless the
  request was valid), never die, and keep serving a pool that runs alongside: that pool is
  stepped between examples and its trajectory checked against the reference model.
* An env writes fuzzed bytes on its real stdout: the worker reports an error (or a valid
  result), never dies, and respawns the env.
* ``serve()`` reads fuzzed request lines from a pipe: it answers with JSON object lines
  only and exits cleanly, never with a Python traceback.

Example counts are fixed (``settings(max_examples=...)``) so the file runs in bounded time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from boltzlabs_gym import RLPool
from boltzlabs_gym.wire.archive import pack_dir
from boltzlabs_gym.wire.protocol import PROTOCOL_VERSION, WORKER_OPS, encode_header

from conftest import COUNTER, ENVS, ISOLATION
from workers import WorkerProcess

pytestmark = pytest.mark.usefixtures("no_leaks")

SOAK = os.path.join(ENVS, "soak")
STDOUT_FUZZ = os.path.join(ENVS, "stdout_fuzz")

_spec = importlib.util.spec_from_file_location("soak_lcg", os.path.join(SOAK, "lcg.py"))
lcg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lcg)

FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
#: Ops that may legitimately succeed without a session.
SESSIONLESS_OK = {"ping", "has_archive", "status", "close"}


class Alongside:
    """A pool sharing the fuzzed worker; every check steps it and compares with the LCG model."""

    def __init__(self, address: str):
        self.n = 3
        self.pool = RLPool(SOAK, n=self.n, workers=[address], isolation=ISOLATION, step_timeout=30)
        self.rng = np.random.default_rng(7)
        self.episode = 0
        self.checks = 0
        self._reset()

    def _reset(self) -> None:
        self.episode += 1
        seeds = [self.episode * 100 + i for i in range(self.n)]
        obs = self.pool.reset(seed=seeds)
        assert obs == [lcg.reset_obs(s, i) for i, s in enumerate(seeds)]
        self.state = [(s, lcg.initial(s, i), 0) for i, s in enumerate(seeds)]

    def check(self) -> None:
        actions = [int(a) for a in self.rng.integers(0, 1000, self.n)]
        obs, rewards, dones, infos = self.pool.step(actions)
        for i, (s, x, t) in enumerate(self.state):
            x, t = lcg.advance(x, actions[i]), t + 1
            assert obs[i] == lcg.step_obs(x, t, i, s), (i, obs[i], infos[i])
            assert rewards[i] == np.float32(lcg.reward(x)) and not any(k.startswith("boltzlabs") for k in infos[i])
            self.state[i] = (s, x, t)
        self.checks += 1
        if dones.any():
            self._reset()


FDS_AT_START: dict[int, int] = {}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzworker")
    worker = WorkerProcess(bind=f"ipc://{d}/w.sock", capacity=16)
    alongside = None
    try:
        alongside = Alongside(worker.address)
        _, digest = pack_dir(SOAK)
        FDS_AT_START[worker.pid] = len(os.listdir(f"/proc/{worker.pid}/fd"))
        yield worker, alongside, digest
    finally:
        if alongside is not None:
            alongside.pool.close()
        worker.stop()


@pytest.fixture
def served_target(served):
    """``served`` plus a second session whose envs the fuzzers may really drive (and respawn).

    Per test, so that the leak check sees its respawned env processes go with it.
    """
    worker, alongside, digest = served
    target = RLPool(SOAK, n=2, workers=[worker.address], isolation=ISOLATION, step_timeout=1.0)
    target.reset(seed=0)
    yield worker, alongside, target, digest
    target.close()


class Client:
    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sent = 0

    def ask(self, frames: list[bytes], timeout: float = 20.0) -> tuple[dict, list[bytes]]:
        self.sock.send_multipart(frames)
        self.sent += 1
        assert self.sock.poll(int(timeout * 1000)), f"no answer to {[f[:120] for f in frames]}"
        reply = self.sock.recv_multipart()
        header = json.loads(reply[0])
        assert isinstance(header, dict), header
        return header, reply[1:]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def client(served):
    c = Client(served[0].address)
    yield c
    c.close()


def _assert_error(header: dict) -> None:
    assert header.get("ok") is False, header
    err = header.get("error")
    assert isinstance(err, dict) and isinstance(err.get("kind"), str) and err["kind"], header
    assert isinstance(err.get("message"), str) and err["message"], header


def _after_example(served) -> None:
    worker, alongside = served[0], served[1]
    assert worker.proc.poll() is None, "the worker died"
    alongside.check()


# ---------------------------------------------------------------- strategies
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
HEADER_FIELDS = [
    "op", "seq", "session", "token", "hash", "n", "items", "isolation", "mode", "limits", "step_timeout",
    "reset_timeout", "start_timeout", "lease_s", "serialize_measurement", "index_offset", "env_vars",
]
deep = st.integers(min_value=2_000, max_value=200_000).map(lambda k: b"[" * k + b"]" * k)


def _dump(h) -> bytes:
    return json.dumps(h, allow_nan=True).encode()


# ---------------------------------------------------------------- client -> worker
RANDOM_HEADERS = 120


@settings(FUZZ, max_examples=RANDOM_HEADERS)
@given(header=st.one_of(st.binary(max_size=300), deep, json_values.map(_dump),
                        st.just(b"\xff" * 8), st.binary(min_size=1, max_size=40).map(lambda b: b'{"v":%d,' % PROTOCOL_VERSION + b)),
       extra=st.lists(st.binary(max_size=64), max_size=3))
@example(header=b"", extra=[])
@example(header=b"[" * 100_000 + b"]" * 100_000, extra=[])
@example(header=b'{"v": %d, "op": "ping"' % PROTOCOL_VERSION , extra=[b"x"])  # truncated
@example(header=_dump({"v": PROTOCOL_VERSION + 1, "op": "ping"}), extra=[])
@example(header=b" " * (1 << 20), extra=[b"\0" * (4 << 20)])  # oversized
def test_random_and_truncated_headers_get_errors(served, client, header, extra):
    reply, _ = client.ask([header, *extra])
    try:
        parsed = json.loads(header)
    except (ValueError, RecursionError):
        parsed = None
    if not (isinstance(parsed, dict) and parsed.get("v") == PROTOCOL_VERSION and parsed.get("op") in SESSIONLESS_OK):
        _assert_error(reply)
    _after_example(served)


WRONG_SHAPES = 200


@settings(FUZZ, max_examples=WRONG_SHAPES)
@given(op=st.one_of(st.sampled_from([*WORKER_OPS, "hard_reset", "step", "reset", ""]), json_values),
       fields=st.dictionaries(st.sampled_from(HEADER_FIELDS[1:]) | st.text(max_size=6), json_values, max_size=8),
       use_target=st.booleans(), extra=st.lists(st.binary(max_size=32), max_size=2))
def test_valid_json_wrong_shape_headers(served_target, client, op, fields, use_target, extra):
    served, target = served_target, served_target[2]
    header = dict(fields, v=PROTOCOL_VERSION, op=op)
    if op == "create" and fields.get("hash") == served[3]:
        header["hash"] = "0" * 64  # never a real create here: that one is exercised field by field below
    if use_target and op in ("batch", "memory", "close", "cancel"):
        link = target._links[0]
        header.setdefault("session", link.session)  # a real session; the token is fuzzed or missing
        if header.get("token") == link.token or op == "close":
            header.pop("token", None)  # a foreign client never knows it
    reply, _ = client.ask([_dump(header), *extra])
    if not (isinstance(op, str) and op in SESSIONLESS_OK and reply.get("ok")):
        _assert_error(reply)
    _after_example(served)


BATCH_ITEMS = 150
_item = st.one_of(
    st.tuples(st.integers(-3, 4) | json_values,
              st.fixed_dictionaries({"op": st.sampled_from(["step", "reset", "describe", "hard_reset", "nope"])},
                                    optional={"action": st.integers(0, 999), "seed": st.integers(0, 9)}) | json_values,
              st.integers(-2, 3) | json_values).map(list),
    json_values,
)


@settings(FUZZ, max_examples=BATCH_ITEMS)
@given(items=st.one_of(st.lists(_item, max_size=5), json_values), frames=st.lists(st.binary(max_size=16), max_size=4))
@example(items=[[0, {"op": "step", "action": 1}, 0], [0, {"op": "step", "action": 1}, 0]], frames=[])  # index twice
@example(items=[[5, {"op": "step", "action": 1}, 0]], frames=[])  # out of range
@example(items=[[0, {"op": "step", "action": 1}, 2]], frames=[b"a"])  # claims frames not sent
@example(items=[[0, {"op": "step", "action": 1}, 0]], frames=[b"extra"])  # unclaimed frame
@example(items=[[True, {"op": "step"}, 0]], frames=[])  # bool is not an index
@example(items=[[0, {"op": "step", "action": 1}, 0], [1, {"op": "reset", "seed": 3}, 0]], frames=[])  # valid
def test_batch_items_with_bad_indices_and_frame_counts(served_target, client, items, frames):
    served, target = served_target, served_target[2]
    link = target._links[0]
    header = {"v": PROTOCOL_VERSION, "op": "batch", "seq": 5, "session": link.session, "token": link.token, "items": items}
    reply, rest = client.ask([_dump(header), *frames])
    valid = (
        isinstance(items, list) and items
        and all(isinstance(it, list) and len(it) == 3 and type(it[0]) is int and 0 <= it[0] < 2
                and isinstance(it[1], dict) and isinstance(it[1].get("op"), str)
                and type(it[2]) is int and it[2] >= 0 for it in items)
        and len({it[0] for it in items}) == len(items)
        and sum(it[2] for it in items) == len(frames)
    )
    if valid:
        assert reply["ok"] is True and reply["seq"] == 5, reply
        assert [r[0] for r in reply["results"]] == [it[0] for it in items]
        # one data frame holding every reply and payload, sized exactly as the results say
        assert len(rest) == 1 and len(rest[0]) == sum(sum(r[2]) for r in reply["results"])
        assert all(len(r[2]) == 1 for r in reply["results"])  # the counter env sends no payloads: a reply each
    else:
        _assert_error(reply)
        assert reply["seq"] == 5
    _after_example(served)


def _good_create(digest: str) -> dict:
    return {"v": PROTOCOL_VERSION, "op": "create", "seq": 1, "hash": digest, "n": 1, "isolation": ISOLATION,
            "mode": "default", "limits": {}, "step_timeout": 5, "reset_timeout": 5, "start_timeout": 30,
            "lease_s": 60, "serialize_measurement": False, "index_offset": 0, "env_vars": {}}


BAD_VALUES = [None, True, -1, 0, 1.5, 2**70, "x", [], {}, [1, "a"], {"a": [None]}, float("nan"), float("inf")]
CREATE_FIELDS = ["hash", "n", "isolation", "mode", "limits", "step_timeout", "reset_timeout", "start_timeout",
                 "lease_s", "index_offset", "env_vars"]
BAD_LIMITS = [{"memory_bytes": "lots"}, {"pids": -5}, {"open_files": 1.5}, {"cpu_seconds_per_step": "x"},
              {"tmpfs_bytes": None}, {"file_size_bytes": [1]}, {"nope": 1}, {"memory_bytes": 2**70}]


def test_wrong_types_for_every_field_of_every_op(served_target, client):
    """Each field of each op, one at a time, replaced by values of the wrong type or range."""
    worker, alongside, target, digest = served_target
    link = target._links[0]
    base = {
        "ping": {"session": link.session, "token": link.token},
        "has_archive": {"hash": digest},
        "upload": {"hash": digest},
        "memory": {"session": link.session, "token": link.token},
        "status": {},
        "close": {"session": "s999999"},
        "batch": {"session": link.session, "token": link.token, "items": [[0, {"op": "describe"}, 0]]},
        "create": _good_create(digest),
    }
    checked = 0
    created = []
    for op, good in base.items():
        fields = CREATE_FIELDS if op == "create" else [*good, "seq"]
        for field in fields:
            values = BAD_VALUES + (BAD_LIMITS if field == "limits" else [])
            for value in values:
                header = dict(good, v=PROTOCOL_VERSION, op=op, seq=1)
                header[field] = value
                frames = [b"not an archive"] if op == "upload" else []
                reply, _ = client.ask([_dump(header)], timeout=60)
                checked += 1
                if reply.get("ok"):
                    if op == "create":
                        created.append(reply)
                        closed, _ = client.ask([_dump({"v": PROTOCOL_VERSION, "op": "close", "seq": 2, "session": reply["session"],
                                                       "token": reply["token"]})])
                        assert closed["ok"] is True, closed
                    # A valid request after all (e.g. seq is any JSON, a falsy env_vars): fine.
                    continue
                _assert_error(reply)
            alongside.check()
            assert worker.proc.poll() is None
    # Only values that are plausibly right may have made a session.
    for reply in created:
        assert reply["n"] == 1
    print(f"\nwrong-type matrix: {checked} requests, {len(created)} accepted as valid creates")


def test_ops_on_closed_and_foreign_sessions(served_target, client):
    worker, alongside, target, digest = served_target
    closed = RLPool(COUNTER, n=1, workers=[worker.address], isolation=ISOLATION)
    link = closed._links[0]
    sid, token = link.session, link.token
    closed.close()
    live = target._links[0]
    cases = [
        ("closed session", {"session": sid, "token": token}),
        ("foreign session, no token", {"session": live.session}),
        ("foreign session, wrong token", {"session": live.session, "token": "0" * 32}),
        ("unknown session", {"session": "s424242", "token": token}),
        ("session of wrong type", {"session": ["s1"], "token": token}),
    ]
    for what, ident in cases:
        for op in ("batch", "memory"):
            header = dict(ident, v=PROTOCOL_VERSION, op=op, seq=9, items=[[0, {"op": "step", "action": 1}, 0]])
            reply, _ = client.ask([_dump(header)])
            _assert_error(reply)
            assert "no open session" in reply["error"]["message"], (what, reply)
        # close of a session this client does not own is a no-op, and the session lives on
        reply, _ = client.ask([_dump(dict(ident, v=PROTOCOL_VERSION, op="close", seq=9))])
        alongside.check()
    assert target.reset(seed=0)[0] == lcg.reset_obs(0, 0)


def test_out_of_order_and_pipelined_requests(served_target, client):
    """Many requests sent before any answer is read, with stale and duplicate seqs."""
    worker, alongside, target, digest = served_target
    link = target._links[0]
    frames = []
    for k in range(40):
        kind = k % 4
        if kind == 0:
            frames.append([_dump({"v": PROTOCOL_VERSION, "op": "ping", "seq": k})])
        elif kind == 1:
            frames.append([b"garbage %d" % k])
        elif kind == 2:
            frames.append([_dump({"v": PROTOCOL_VERSION, "op": "batch", "seq": k, "session": link.session, "token": link.token,
                                  "items": [[0, {"op": "describe"}, 0], [1, {"op": "describe"}, 0]]})])
        else:
            frames.append([_dump({"v": PROTOCOL_VERSION, "op": "batch", "seq": 7, "session": link.session, "items": []})])
    for f in frames:
        client.sock.send_multipart(f)
    replies = []
    while len(replies) < len(frames):
        assert client.sock.poll(20_000), f"only {len(replies)} of {len(frames)} answered"
        replies.append(json.loads(client.sock.recv_multipart()[0]))
    assert sum(1 for r in replies if r.get("ok")) == 20  # pings and valid batches
    assert all(r.get("ok") or r["error"]["kind"] for r in replies)
    alongside.check()


# ---------------------------------------------------------------- env stdout -> worker
ENV_STDOUT = 40
_line = st.one_of(
    json_values.map(lambda v: _dump(v) + b"\n"),
    st.binary(max_size=200),
    st.builds(lambda n, tail: b'{"_bin":[%d]}\n' % n + tail, st.integers(0, 1 << 20), st.binary(max_size=64)),
    st.builds(lambda v: _dump({"_bin": v}) + b"\n", json_values),
    deep.map(lambda b: b + b"\n"),
)


@pytest.fixture
def stdout_pool(served):
    pool = RLPool(STDOUT_FUZZ, n=2, workers=[served[0].address], isolation=ISOLATION, step_timeout=1.0,
                  reset_timeout=10.0)
    yield pool
    pool.close()


@settings(FUZZ, max_examples=ENV_STDOUT)
@given(payload=st.lists(_line, min_size=1, max_size=3).map(b"".join),
       then=st.sampled_from(["reply", "reply", "reply", "exit", "hang"]))
@example(payload=b"[" * 70_000 + b"]" * 70_000 + b"\n", then="reply")
@example(payload=b'{"obs": 1}\n', then="reply")  # a forged complete reply, then the real one
@example(payload=b'{"_bin": [16777216]}\n', then="reply")  # announces bytes that never come
@example(payload=b"\x00" * 70_000, then="exit")
def test_env_writing_fuzzed_bytes_on_its_stdout(served, stdout_pool, payload, then):
    pool = stdout_pool
    obs, rewards, dones, infos = pool.step([{"hex": payload.hex(), "then": then}, 1])
    assert obs[1] == {"t": obs[1]["t"], "i": 1} and rewards[1] == 1.0 and not infos[1], infos[1]
    report = infos[0].get("boltzlabs_error") or infos[0].get("boltzlabs_straggler")
    if report is None:
        assert pool.timing.errors == pool.timing.stragglers == ()  # a valid (if forged) result
    else:
        assert report["reason"] and pool.timing.errors + pool.timing.stragglers == (0,)
    # The worker lives and respawns the env; the other env and the other session are unharmed.
    # Without request ids a hostile env can spoil its own next reply (a death right after its
    # reply races with the next request; a forged extra reply is taken for the next call's), but
    # each such glitch gets it killed and respawned: it must be clean again within a few resets.
    for attempt in range(4):
        obs = pool.reset()
        assert obs[1] == {"t": 0, "i": 1}, (obs, pool.reset_infos)
        if obs[0] == {"t": 0, "i": 0}:
            break
    else:
        raise AssertionError(f"env 0 did not recover after 4 resets: {obs} {pool.reset_infos}")
    obs, *_ = pool.step([1, 1])
    assert obs == [{"t": 1, "i": 0}, {"t": 1, "i": 1}]
    _after_example(served)


# ---------------------------------------------------------------- worker -> serve()
SERVE_LINES = 60
_SERVE_ENV = textwrap.dedent("""
    from boltzlabs_gym.env import serve
    serve(reset=lambda seed, options=None: {"seed": seed}, step=lambda a: ({"a": a}, 1.0, False, {}))
""")
_request = st.one_of(
    st.fixed_dictionaries({"op": st.sampled_from(["step", "reset", "describe", "close", "bogus"])},
                          optional={"action": json_values, "seed": json_values, "options": json_values,
                                    "autoreset": json_values}).map(lambda d: _dump(d) + b"\n"),
    json_values.map(lambda v: _dump(v) + b"\n"),
    st.binary(max_size=100).map(lambda b: b.replace(b"\n", b"") + b"\n"),
    st.builds(lambda n, tail: b'{"op":"step","_bin":[%d]}\n' % n + tail, st.integers(0, 300), st.binary(max_size=40)),
    st.builds(lambda v: _dump({"op": "step", "_bin": v}) + b"\n", json_values),
    deep.map(lambda b: b + b"\n"),
)


@settings(FUZZ, max_examples=SERVE_LINES)
@given(lines=st.lists(_request, min_size=1, max_size=6), torn=st.binary(max_size=30))
@example(lines=[b"[" * 100_000 + b"]" * 100_000 + b"\n"], torn=b"")
@example(lines=[b'{"op":"step","_bin":[1000]}\n'], torn=b"short")
@example(lines=[b'{"op":"reset","seed":1}\n'], torn=b'{"op":"st')
@example(lines=[b'{"op":"step","_bin":[-1]}\n'], torn=b"")
@example(lines=[b'{"op":"step","_bin":[true]}\n'], torn=b"")
def test_serve_against_malformed_request_lines(tmp_path, lines, torn):
    proc = subprocess.run(
        [sys.executable, "-c", _SERVE_ENV], input=b"".join(lines) + torn, capture_output=True, timeout=60,
        env={**os.environ, "BOLTZLABS_ENV_DIR": str(tmp_path), "BOLTZLABS_WORKSPACE": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()[-2000:]
    out = proc.stdout.split(b"\n")
    assert out[-1] == b"", "the channel must end with a complete line"
    replies = [json.loads(line) for line in out[:-1]]
    assert all(isinstance(r, dict) for r in replies), replies
    assert len(replies) <= len(lines) + 1


def test_worker_fds_did_not_grow_over_the_fuzzing(served):
    """Runs last: after every fuzzed request, respawn and closed session, the worker holds no more fds."""
    from workers import wait_until

    worker, alongside = served[0], served[1]
    alongside.check()
    start = FDS_AT_START[worker.pid]
    count = lambda: len(os.listdir(f"/proc/{worker.pid}/fd"))  # noqa: E731
    assert wait_until(lambda: count() <= start, 10), f"worker fds {start} -> {count()}"
