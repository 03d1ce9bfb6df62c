"""Hostile env directories: escaping archives, archive bombs, envs that attack their host.

Each case is refused or contained with a clear error. The contained cases need real
isolation (a pid namespace, hidden host files); under a weaker backend they are skipped
with the reason, never passed silently.
"""

from __future__ import annotations

import glob
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
import tracemalloc
import uuid
import zlib

import numpy as np
import psutil
import pytest
import zmq

from boltzlabs_gym import EnvStartError, RLPool
from boltzlabs_gym.wire.archive import MAX_HEADER_BYTES, ArchiveLimits, archive_hash, pack_dir, unpack_archive
from boltzlabs_gym.errors import ArchiveError
from boltzlabs_gym.wire.protocol import decode_header, encode_header
from boltzlabs_gym.testing import alive

from conftest import COUNTER, ENVS, FAULTY, ISOLATION
from workers import WorkerProcess, wait_until

pytestmark = pytest.mark.usefixtures("no_leaks")

HOSTILE = os.path.join(ENVS, "hostile")
NEVER_ANSWERS = os.path.join(ENVS, "never_answers")
DEFAULT_LIMITS = ArchiveLimits()


def _sleepers(marker: str) -> list:
    return alive([p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]])


def _need(pool: RLPool, *props: str) -> None:
    missing = [p for p in props if not pool.isolation.properties.get(p)]
    if missing:
        pytest.skip(f"isolation {pool.isolation.backend} lacks {missing}: this attack is not contained there")


# ---------------------------------------------------------------- archives: the pack side
def test_pack_dir_refuses_symlinks_leaving_the_tree(tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    (env / "env.py").write_text("print('hi')\n")
    (env / "data").mkdir()
    (env / "data" / "inside.txt").write_text("ok")
    (env / "data" / "alias.txt").symlink_to("inside.txt")  # stays inside: fine
    (env / "up.txt").symlink_to("data/inside.txt")
    pack_dir(env)
    outside = tmp_path / "secret.txt"
    outside.write_text("host secret")
    for name, target in [("abs", str(outside)), ("rel", "../secret.txt"), ("deep", "data/../../secret.txt"),
                         ("etc", "/etc/passwd")]:
        link = env / f"link_{name}"
        link.symlink_to(target)
        with pytest.raises(ArchiveError, match="leaves the env directory"):
            pack_dir(env)
        link.unlink()
    # a directory symlink pointing outside is refused too (it would mount the host into /env)
    (env / "hostdir").symlink_to(tmp_path)
    with pytest.raises(ArchiveError, match="leaves the env directory"):
        pack_dir(env)
    (env / "hostdir").unlink()
    os.mkfifo(env / "fifo")
    with pytest.raises(ArchiveError, match="only regular files"):
        pack_dir(env)


# ---------------------------------------------------------------- archives: the worker side
def _gz_stream(chunks) -> bytes:
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip container
    out = [comp.compress(c) for c in chunks]
    out.append(comp.flush())
    return b"".join(out)


def _zip_bomb(unpacked: int) -> bytes:
    """A valid .tar.gz holding one file of ``unpacked`` zero bytes, built without holding it."""
    info = tarfile.TarInfo("bomb.bin")
    info.size = unpacked

    def chunks():
        yield info.tobuf(tarfile.USTAR_FORMAT)
        block = b"\0" * (1 << 20)
        for _ in range(unpacked >> 20):
            yield block
        yield b"\0" * (unpacked % (1 << 20))
        yield b"\0" * (-unpacked % 512 + 1024)  # padding and the end-of-archive blocks

    return _gz_stream(chunks())


def _many_files_raw(count: int, content: bytes = b"") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(count):
            info = tarfile.TarInfo(f"f{i}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return raw.getvalue()


def _many_files(count: int) -> bytes:
    return _gz_stream([_many_files_raw(count)])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostileworker")
    w = WorkerProcess(bind=f"ipc://{d}/w.sock", capacity=8)
    yield w
    w.stop()


def _send_upload(ctx, address: str, data: bytes, seq: int = 1, digest: str | None = None):
    """A DEALER that has sent ``data`` as an upload announced as ``digest`` (its real hash by default)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    header = {"op": "upload", "seq": seq, "hash": archive_hash(data) if digest is None else digest}
    sock.send_multipart([encode_header(header), data], copy=False)
    return sock


def _upload(address: str, data: bytes, timeout: float = 120.0, digest: str | None = None) -> dict:
    ctx = zmq.Context()
    try:
        sock = _send_upload(ctx, address, data, digest=digest)
        assert sock.poll(int(timeout * 1000)), "worker did not answer the upload"
        return decode_header(sock.recv_multipart()[0])
    finally:
        ctx.destroy(linger=0)


def _worker_root(pid: int) -> str:
    """The working directory of the worker process ``pid`` (under this run's TMPDIR)."""
    roots = [d for d in glob.glob(os.path.join(os.environ["TMPDIR"], "boltzlabs-worker-*")) if _owner(d) == str(pid)]
    assert len(roots) == 1, roots
    return roots[0]


def _owner(worker_dir: str) -> str | None:
    """The pid a worker directory names, if it still has one (another worker may be starting,
    stopping or sweeping it meanwhile)."""
    try:
        with open(os.path.join(worker_dir, "owner.pid")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("case", ["unpacked_size", "file_count", "packed_size"])
def test_huge_archives_are_refused_by_the_worker(worker, case):
    if case == "unpacked_size":
        data = _zip_bomb(DEFAULT_LIMITS.max_unpacked_bytes + (8 << 20))  # ~520 MiB in well under 1 MiB
        assert len(data) < 1 << 20
        want = f"unpacks to more than {DEFAULT_LIMITS.max_unpacked_bytes} bytes"
    elif case == "file_count":
        data = _many_files(DEFAULT_LIMITS.max_files + 1)
        want = f"{DEFAULT_LIMITS.max_files + 1} entries or more, over the worker's limit of {DEFAULT_LIMITS.max_files}"
    else:
        data = bytes(DEFAULT_LIMITS.max_packed_bytes + 1)
        want = f"over the worker's limit of {DEFAULT_LIMITS.max_packed_bytes}"
    reply = _upload(worker.address, data)
    assert reply["ok"] is False and reply["error"]["kind"] == "archive", reply
    assert want in reply["error"]["message"], reply
    # nothing of it stayed on disk, and the worker still serves
    left = [n for n in os.listdir(os.path.join(_worker_root(worker.pid), "archives")) if archive_hash(data) in n]
    assert not left, left  # neither the archive nor its (hidden) staging directory
    assert _upload(worker.address, pack_dir(HOSTILE)[0])["ok"] is True


def _slow_archive(tag: bytes) -> bytes:
    """An archive that takes seconds to unpack (20,000 files), distinct per ``tag``: the
    module's worker keeps what it unpacked, and would answer a repeat at once."""
    return _gz_stream([_many_files_raw(DEFAULT_LIMITS.max_files - 10, content=tag)])


def _staging_of(archives: str, data: bytes) -> bool:
    """Whether the worker is unpacking ``data`` (its hidden staging directory exists)."""
    return os.path.isdir(archives) and any(n.startswith(f".{archive_hash(data)}.") for n in os.listdir(archives))


def _worker_archives(worker) -> str:
    return os.path.join(_worker_root(worker.pid), "archives")


def test_an_upload_being_unpacked_does_not_stall_other_sessions(worker):
    """20,000 files take seconds to unpack; another client's envs keep stepping meanwhile,
    and the upload is answered when it is done (before, the worker unpacked inside its
    event loop and every other session waited for it)."""
    slow = _slow_archive(b'stall')
    archives = _worker_archives(worker)
    ctx = zmq.Context()
    try:
        with RLPool(COUNTER, n=2, workers=[worker.address], isolation=ISOLATION) as pool:
            pool.reset()
            uploader = _send_upload(ctx, worker.address, slow)
            # The worker is inside this upload once its staging directory exists.
            assert wait_until(lambda: _staging_of(archives, slow), 30, 0.005)
            t0 = time.monotonic()
            for t in (1, 2, 3):
                obs, _, _, infos = pool.step([1, 1])
                assert obs == [{"t": t}, {"t": t}], (obs, infos)
            stepped_in = time.monotonic() - t0
            assert not uploader.poll(0), f"the upload was answered before 3 steps ({stepped_in:.2f} s) of another session"
            assert uploader.poll(120_000), "worker did not answer the upload"
            reply = decode_header(uploader.recv_multipart()[0])
            assert reply["ok"] is True and reply["seq"] == 1, reply
        assert os.path.isfile(os.path.join(archives, archive_hash(slow), "f0"))
        assert not _staging_of(archives, slow)
    finally:
        ctx.destroy(linger=0)


def test_the_same_archive_uploaded_twice_at_once_is_unpacked_once(worker):
    data = _many_files(2_000)
    ctx = zmq.Context()
    try:
        socks = [_send_upload(ctx, worker.address, data, seq) for seq in (7, 8)]
        replies = []
        for sock in socks:
            assert sock.poll(60_000), "worker did not answer the upload"
            replies.append(decode_header(sock.recv_multipart()[0]))
        assert [(r["ok"], r["seq"]) for r in replies] == [(True, 7), (True, 8)], replies
        assert [n for n in os.listdir(_worker_archives(worker)) if archive_hash(data) in n] == [archive_hash(data)]
    finally:
        ctx.destroy(linger=0)


def test_a_bad_upload_of_a_digest_does_not_fail_another_clients_good_one(worker):
    """Client A announces digest H with the wrong bytes while client B sends H's real archive:
    A gets the error, B's archive is unpacked. (Both wait behind a slow third archive, so
    B's request arrives while A's is still pending; A's ping is answered before B sends, so the
    worker has A's upload first. Were B's first, A's bytes would never be checked and A would
    rightly get B's archive.)"""
    slow = _slow_archive(b'liar')
    good = _many_files(50)
    digest = archive_hash(good)
    archives = _worker_archives(worker)
    ctx = zmq.Context()
    try:
        first = _send_upload(ctx, worker.address, slow)
        assert wait_until(lambda: _staging_of(archives, slow), 30, 0.005)
        liar = _send_upload(ctx, worker.address, _many_files(60), seq=2, digest=digest)
        liar.send_multipart([encode_header({"op": "ping", "seq": 20})])
        assert liar.poll(30_000), "worker did not answer the ping behind the liar's upload"
        assert decode_header(liar.recv_multipart()[0])["seq"] == 20
        honest = _send_upload(ctx, worker.address, good, seq=3)
        replies = {}
        for name, sock in (("first", first), ("liar", liar), ("honest", honest)):
            assert sock.poll(120_000), f"worker did not answer the {name} upload"
            replies[name] = decode_header(sock.recv_multipart()[0])
        assert replies["first"]["ok"] is True, replies
        assert replies["liar"]["ok"] is False and "does not match its announced hash" in replies["liar"]["error"]["message"]
        assert replies["honest"]["ok"] is True and replies["honest"]["seq"] == 3, replies
        assert os.path.isfile(os.path.join(archives, digest, "f49"))
        assert not os.path.exists(os.path.join(archives, digest, "f59"))
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("digest", ["../../escaped", "a" * 63, "A" * 64, "/tmp/x" + "0" * 58])
def test_an_upload_hash_that_is_no_digest_is_refused_before_it_names_a_directory(worker, digest):
    data = pack_dir(HOSTILE)[0]
    reply = _upload(worker.address, data, digest=digest)
    assert reply["ok"] is False and reply["error"]["kind"] == "archive", reply
    assert "is not a SHA-256 hex digest" in reply["error"]["message"], reply
    archives = _worker_archives(worker)
    assert not [n for n in os.listdir(archives) if n.startswith(".")]
    assert not os.path.exists(os.path.join(archives, digest))


def test_a_cancelled_unpack_stops_and_leaves_nothing(tmp_path):
    import threading

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ArchiveError, match="cancelled"):
        unpack_archive(_many_files(10), str(tmp_path / "dest"), cancel=cancel)
    assert os.listdir(tmp_path) == []


def test_worker_shutdown_cancels_an_upload_in_progress(tmp_path):
    """Uploads.close() (the worker's shutdown) stops an unpack mid-way, without waiting for
    the rest of it, and removes its staging tree."""
    from boltzlabs_gym.worker.uploads import Uploads

    slow = _slow_archive(b'cancel')
    uploads = Uploads(DEFAULT_LIMITS)
    uploads.submit(archive_hash(slow), slow, str(tmp_path / "dest"), waiter="w")
    assert uploads.in_progress(archive_hash(slow))
    assert wait_until(lambda: any(n.endswith(".unpacking") and len(os.listdir(tmp_path / n)) > 100
                                  for n in os.listdir(tmp_path)), 30, 0.005)
    uploads.close()
    left = os.listdir(tmp_path)
    assert left == [], left


def test_archive_limits_in_process():
    """The same three limits, tight, straight on unpack_archive (nothing is written when refused)."""
    tiny = ArchiveLimits(max_unpacked_bytes=1 << 20, max_packed_bytes=64 << 10, max_files=10)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for data, want in [
            (_zip_bomb(2 << 20), "unpacks to more than"),
            (_many_files(11), "11 entries or more"),
            (os.urandom(65 << 10), "over the worker's limit of 65536"),
        ]:
            dest = os.path.join(d, uuid.uuid4().hex)
            with pytest.raises(ArchiveError, match=want):
                unpack_archive(data, dest, limits=tiny)
            assert not os.path.exists(dest)


def _pax_header(size: int) -> bytes:
    """A ustar block for a PAX extended header that declares ``size`` bytes of records."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = size
    return info.tobuf(tarfile.USTAR_FORMAT)


def test_archive_headers_are_bounded_before_they_are_read():
    """tarfile reads a PAX header in one read of its declared size and keeps it with the
    member: a huge one, or many large ones, are refused without being held in memory."""
    import tempfile

    declared = 64 << 20
    huge_header = _gz_stream([_pax_header(declared), b"\0" * declared])
    # extended headers of ~1 MiB, all read before the one entry they precede
    many_headers = b"".join(
        tarfile.TarInfo._create_pax_generic_header({f"k{i}": "x" * ((1 << 20) - 4096)}, tarfile.XHDTYPE, "utf-8")
        for i in range(MAX_HEADER_BYTES // (1 << 20) + 1)
    ) + tarfile.TarInfo("f").tobuf(tarfile.USTAR_FORMAT) + b"\0" * 1024
    global_header = io.BytesIO()
    with tarfile.open(fileobj=global_header, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}) as tar:
        tar.addfile(tarfile.TarInfo("f"), io.BytesIO(b""))
    with tempfile.TemporaryDirectory() as d:
        for data, want in [
            (huge_header, f"tar header of {declared} bytes"),
            (_gz_stream([many_headers]), f"more than {MAX_HEADER_BYTES} bytes of tar headers for one entry"),
            (_gz_stream([global_header.getvalue()]), "global PAX header"),
        ]:
            dest = os.path.join(d, uuid.uuid4().hex)
            tracemalloc.start()
            try:
                with pytest.raises(ArchiveError, match=want):
                    unpack_archive(data, dest)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < 3 * MAX_HEADER_BYTES, f"held {peak >> 20} MiB"
            assert not os.path.exists(dest) and not os.listdir(d), os.listdir(d)


def test_archive_is_decompressed_as_it_is_read():
    """A bomb over the limit is refused after reading the limit, never holding it."""
    import tempfile

    limits = ArchiveLimits(max_unpacked_bytes=64 << 20)
    with tempfile.TemporaryDirectory() as d:
        tracemalloc.start()
        try:
            with pytest.raises(ArchiveError, match="unpacks to more than"):
                unpack_archive(_zip_bomb(96 << 20), os.path.join(d, "x"), limits=limits)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"held {peak >> 20} MiB of a 96 MiB bomb"
        assert not os.listdir(d), os.listdir(d)
        many = os.path.join(d, "many")  # 20,000 entries: ~20 MiB of ustar headers and padding in all
        unpack_archive(_gz_stream([_many_files_raw(20_000, b"y" * 100)]), many)
        assert len(os.listdir(many)) == 20_000
        ok = os.path.join(d, "ok")
        os.makedirs(ok)  # an empty directory is a valid destination, a non-empty one is not
        unpack_archive(pack_dir(HOSTILE)[0], ok)
        assert os.path.isfile(os.path.join(ok, "env.py"))
        with pytest.raises(ArchiveError, match="not empty"):
            unpack_archive(pack_dir(HOSTILE)[0], ok)


def _tar(*entries) -> bytes:
    """A .tar.gz of (name, kind, payload) entries in this order; kind: file, dir, link."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, payload
                tar.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return _gz_stream([raw.getvalue()])


@pytest.mark.parametrize("entries, want", [
    # each link looks inside on its own; together they reach the parent of the tree
    ([("s1", "link", "."), ("s2", "link", "s1/.."), ("x", "link", "s2/victim.txt"), ("x", "file", b"pwned")],
     "two entries at 'x'"),
    ([("s1", "link", "."), ("s2", "link", "s1/.."), ("s2/outside/f", "file", b"pwned")],
     "written through the symlink 's2'"),
    ([("s1", "link", "."), ("s2", "link", "s1/..")], "'s2' links outside the env directory through other links"),
    # the chain completed by a later entry
    ([("a", "link", "d/.."), ("d", "link", ".")], "'a' links outside the env directory through other links"),
    ([("a", "file", b"1"), ("a", "file", b"2")], "two entries at 'a'"),
    ([("a", "file", b"1"), ("a/b", "file", b"2")], "written through the file 'a'"),
    ([("d", "dir", None), ("d", "file", b"2")], "two entries at 'd'"),
])
def test_archive_entries_never_follow_or_replace_links(tmp_path, entries, want):
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ArchiveError, match=want):
        unpack_archive(_tar(*entries), str(work / "dest"))
    assert os.listdir(tmp_path) == ["work"] and os.listdir(work) == [], (os.listdir(tmp_path), os.listdir(work))


def test_broken_archives_are_archive_errors(tmp_path):
    good = _tar(("d", "dir", None), ("d/f", "file", b"x" * 5000), ("d/l", "link", "f"))
    dest = tmp_path / "ok"
    unpack_archive(good, str(dest))
    assert (dest / "d" / "f").read_bytes() == b"x" * 5000 and os.readlink(dest / "d" / "l") == "f"
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o755
    raw = zlib.decompress(good, 31)
    for data, want in [
        (_gz_stream([raw[:2048]]), "could not be unpacked|not a valid tar"),  # cut inside d/f's data
        (good[:-8] + bytes(8), "not a valid gzip stream"),  # CRC and length trailer zeroed
        (_gz_stream([raw, b"\1" * (2 << 20)]), "after the end of its tar"),
    ]:
        target = tmp_path / uuid.uuid4().hex
        with pytest.raises(ArchiveError, match=want):
            unpack_archive(data, str(target))
        assert not target.exists()
    assert sorted(os.listdir(tmp_path)) == ["ok"], os.listdir(tmp_path)


# ---------------------------------------------------------------- envs that misbehave
def test_env_that_never_answers_its_first_reset():
    t0 = time.monotonic()
    with pytest.raises(EnvStartError, match="deadline") as info:
        RLPool(NEVER_ANSWERS, n=3, isolation=ISOLATION, start_timeout=2.0)
    assert time.monotonic() - t0 < 20
    index = info.value.index
    assert index in (0, 1, 2) and f"env {index}" in str(info.value)
    assert "start-up" in str(info.value)
    assert "never_answers: sleeping instead of serving" in info.value.stderr_tail


def test_env_that_daemonizes_is_gone_after_hard_reset_and_close():
    with RLPool(HOSTILE, n=2, isolation=ISOLATION) as pool:
        _need(pool, "pid_namespace")
        pool.reset()
        marker = f"{5000 + os.getpid() % 1000 + 0.123:.3f}"
        obs, rewards, dones, infos = pool.step([{"daemon": marker}, 1])
        assert obs[0]["daemon_pid"] > 1 and not dones[0], infos[0]
        assert wait_until(lambda: len(_sleepers(marker)) == 1, 5), "the daemon did not start"
        pool.reset(hard=True)
        assert wait_until(lambda: not _sleepers(marker), 10), "a setsid daemon outlived the hard reset"
        pool.step([1, {"daemon": marker}])
        assert wait_until(lambda: len(_sleepers(marker)) == 1, 5)
        worker = psutil.Process(pool._links[0].process.pid)
    assert wait_until(lambda: not _sleepers(marker), 10), "a setsid daemon outlived close()"
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("then, want", [("stay", "closed its stdout but did not exit"), ("exit", "exited with status 0")])
def test_env_that_closes_its_stdout(then, want):
    with RLPool(HOSTILE, n=3, isolation=ISOLATION, step_timeout=10.0) as pool:
        pool.reset()
        t0 = time.monotonic()
        obs, rewards, dones, infos = pool.step([1, {"close_channel": then}, 1])
        assert time.monotonic() - t0 < 8, "a closed channel must not wait for the step deadline"
        err = infos[1].get("boltzlabs_error")
        assert err is not None and want in err["reason"], infos[1]
        assert obs[1] is None and dones[1] and pool.timing.errors == (1,)
        assert obs[0] == obs[2] or (obs[0]["index"], obs[2]["index"]) == (0, 2)
        assert pool.reset() == [{"index": i, "seed": None} for i in range(3)]  # respawned


def test_env_that_spins_the_cpu_is_a_straggler_and_others_are_fine():
    n = 4
    with RLPool(HOSTILE, n=n, isolation=ISOLATION, step_timeout=1.0) as pool:
        pool.reset()
        t0 = time.monotonic()
        obs, rewards, dones, infos = pool.step([1, 1, {"spin": True}, 1])
        elapsed = time.monotonic() - t0
        assert 1.0 <= elapsed < 1.0 + 3.0, elapsed
        assert "deadline" in infos[2]["boltzlabs_straggler"]["reason"] and pool.timing.stragglers == (2,)
        assert [o["index"] for i, o in enumerate(obs) if i != 2] == [0, 1, 3]
        assert np.all(rewards[[0, 1, 3]] == 1.0) and not dones[[0, 1, 3]].any()
        assert pool.reset()[2] == {"index": 2, "seed": None}
        obs, *_ = pool.step([1] * n)
        assert pool.timing.stragglers == () and obs[2]["index"] == 2


def test_env_cannot_read_the_worker_or_other_envs(monkeypatch):
    secret = f"hostile-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("BOLTZLABS_HOSTILE_SECRET", secret)  # the worker inherits it from the trainer
    with RLPool(HOSTILE, n=2, isolation=ISOLATION) as pool:
        _need(pool, "pid_namespace", "hidden_host_files", "scrubbed_environment")
        pool.reset()
        worker_pid = pool._links[0].process.pid
        assert secret in open(f"/proc/{worker_pid}/environ").read()  # it is there to be stolen
        obs, *_ = pool.step([{"write": "secret.txt"}, 1])
        root = _worker_root(worker_pid)
        host_ws0 = glob.glob(os.path.join(root, "sessions", "*", "ws", "0"))[0]
        assert os.path.exists(os.path.join(host_ws0, "secret.txt"))
        attacks = [
            {"read": f"/proc/{worker_pid}/environ"},
            {"read": f"/proc/{os.getpid()}/environ"},
            {"read": f"/proc/{worker_pid}/cmdline"},
            {"read": os.path.join(host_ws0, "secret.txt")},
            {"listdir": host_ws0},
            {"listdir": os.path.dirname(host_ws0)},
            {"read": "/workspace/../ws/0/secret.txt"},
            {"listdir": "/proc"},
            {"signal": worker_pid},
        ]
        for attack in attacks:
            obs, rewards, dones, infos = pool.step([1, attack])
            what = next(k for k in attack)
            result = obs[1][what]
            text = json.dumps(obs[1])
            assert secret not in text and "secret of env 0" not in text, (attack, obs[1])
            assert "BOLTZLABS_HOSTILE_SECRET" not in obs[1]["environ"]
            if what == "listdir" and attack[what] == "/proc":
                # its own pid namespace: only its own processes are visible
                assert result["ok"] and str(worker_pid) not in result["result"], result
                assert max(int(p) for p in result["result"] if p.isdigit()) < 100, result
            else:
                assert result["ok"] is False, (attack, result)
                assert result["error"] in ("FileNotFoundError", "PermissionError", "ProcessLookupError"), result


# ---------------------------------------------------------------- the trainer side
def test_sigint_during_a_long_step_exits_cleanly(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys
        # Python's own SIGINT handler, even if whatever started the tests ignored SIGINT (a
        # background job of a non-interactive shell does, and exec passes that on).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from boltzlabs_gym import RLPool
        with RLPool({FAULTY!r}, n=3, isolation={ISOLATION!r}, step_timeout=30) as pool:
            pool.reset()
            try:  # READY inside: a SIGINT that comes before the step starts is caught the same
                print("READY", pool._links[0].process.pid, flush=True)
                pool.step([{{"sleep": 5}}, 1, 1])
            except KeyboardInterrupt:
                print("INTERRUPTED", flush=True)
                raise
        print("UNREACHABLE", flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "READY", (line, proc.stderr.read() if proc.poll() is not None else "")
        worker = psutil.Process(int(line[1]))
        tree = [worker] + worker.children(recursive=True)
        time.sleep(0.5)  # well inside the 5 s step
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "INTERRUPTED" in out and "UNREACHABLE" not in out, (out, err)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert elapsed < 4.5, f"the trainer waited for the step ({elapsed:.1f} s) instead of stopping"
    assert wait_until(lambda: not alive(tree), 15), "worker or env processes outlived the interrupted trainer"


# ---------------------------------------------------------------- `boltzlabs-gym check` explains protocol violations
def _check(env_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "boltzlabs_gym.cli", "check", str(env_dir), "--isolation", ISOLATION],
                          capture_output=True, text=True, timeout=120)


def test_check_explains_garbage_on_stdout_before_the_first_reply(tmp_path):
    (tmp_path / "env.py").write_text(
        "import os\nos.write(1, b'loading simulator...\\n')\n"
        "from boltzlabs_gym.env import serve\nserve(reset=lambda seed: 0, step=lambda a: (0, 1.0, False, {}))\n"
    )
    out = _check(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not a JSON line (starts with 'loading simulator...')" in out.stdout
    assert "wrote to the env's stdout outside serve()" in out.stdout and "Write logs to stderr" in out.stdout


def test_check_explains_garbage_on_the_channel_during_a_step(tmp_path):
    (tmp_path / "env.py").write_text(
        "import os\nREAL = os.dup(1)\n"
        "from boltzlabs_gym.env import serve\n"
        "def step(a):\n    os.write(REAL, b'progress 50%\\n')\n    return 0, 1.0, False, {}\n"
        "serve(reset=lambda seed: 0, step=step)\n"
    )
    out = _check(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 0: the env error: malformed reply" in out.stdout
    assert "wrote to the env's stdout outside serve()" in out.stdout


def test_check_explains_missing_keys_and_non_object_info(tmp_path):
    # An env speaking the line protocol by hand, and getting it wrong.
    (tmp_path / "env.py").write_text(textwrap.dedent("""
        import json, sys
        for line in sys.stdin:
            op = json.loads(line).get("op")
            reply = {"obs": 0} if op == "reset" else {} if op == "describe" else {"obs": 1, "info": "fine"}
            sys.stdout.write(json.dumps(reply) + "\\n")
            sys.stdout.flush()
    """))
    out = _check(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step reply has no 'reward' key" in out.stdout
    assert "neither 'terminated' nor 'done'" in out.stdout
    assert "step info must be a JSON object, got str" in out.stdout
