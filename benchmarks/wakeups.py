#!/usr/bin/env python
"""Cross-process wake-ups: what one batched step pays to wake N env processes and be woken by them.

    python benchmarks/wakeups.py                          # N = 1, 8, 64; every mechanism
    python benchmarks/wakeups.py --sizes 8 --seconds 1 --modes pipe,futex20

Standalone: no boltzlabs_gym import, no env, no sandbox; only the mechanism a step uses to
hand N envs their requests and learn that all of them answered. A "trainer" (this process)
and N forked "env" processes; each batch, the trainer sends every env a request and waits
until *all N* have answered, as ``BoltzLabsVecEnv.step`` does. Mechanisms:

* ``pipe``: what the library's direct lane does today. A request line is written to each
  env's stdin pipe; the env (blocked in ``read``) answers a reply line on its stdout pipe;
  the trainer waits on all the stdout pipes with ``epoll`` and reads each reply.
* ``eventfd``: the same with an eventfd pair per env (8-byte counters instead of lines).
* ``futexS``: a request word and a reply word per env in a shared ``memfd`` mapping. Each
  side spins on the word it waits for for S microseconds (0, 2, 20, 100), then sleeps in
  ``FUTEX_WAIT`` (``syscall(202)``, x86_64); the side that writes a word always calls
  ``FUTEX_WAKE`` after it (a system call, but no context switch when nobody sleeps).
  The trainer spins on all N reply words at once, then sleeps on the first still unanswered.
* ``futexTS``: the trainer spins S microseconds; the envs sleep at once (with N envs on two
  CPUs, N spinning envs take the CPUs from the trainer and from each other).
* ``futexflagS``: as ``futexS``, but the writer calls ``FUTEX_WAKE`` only when the reader has
  raised a "sleeping" flag. Without an atomic fence between storing the word and loading
  the flag (Python has none) a wake-up can be lost, so sleeps time out after 2 ms and the
  table counts the sleeps that timed out with the word already written (``lost``).
* ``batch``: for reference, one process that serves all N envs (``envs_per_sandbox=N``):
  one request line with N actions down one pipe, one reply with N results back.

With ``--gap-us G`` the trainer sleeps G microseconds before each batch (untimed), as a
trainer that spends time on its policy between steps: an env's spin then outlasts the gap
only when G is shorter than the spin, which the default ``G = 0`` flatters.

Per batch: latency (median, p90 over every batch of every round), CPU (trainer + envs, from
``/proc/<pid>/schedstat``, nanoseconds of CPU, over the timed blocks), and context switches
(voluntary = the process slept and was woken; involuntary = preempted). Rounds rotate the
order of the mechanisms so each is timed in several stretches of a shared machine's life.
Prints a Markdown table with the date, ``uptime`` and CPU count. ``--calls`` instead times each
mechanism's calls in one process with nobody waiting (the cost of a wake-up before any switch). Every forked process is
waited for; the script checks at the end that none of its children is left.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time

REQUEST = b'{"op":"step","action":1}\n'
REPLY = b'{"obs":[0.01,0.02,0.03,0.04],"reward":1.0,"terminated":false,"truncated":false,"info":{}}\n'
SLOT = 128  # bytes per env in the shared region: request word, reply word, flags, each in its own 32 bytes
REQ, REP, ENV_SLEEPS, TRAINER_SLEEPS = 0, 32, 64, 96
STOP = 0xFFFFFFFF
FLAG_TIMEOUT_S = 0.002
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared between processes


# --------------------------------------------------------------------------- futex
class Futex:
    """``FUTEX_WAIT`` / ``FUTEX_WAKE`` on 32-bit words of a shared mapping, through ``syscall``."""

    def __init__(self):
        nr = SYS_FUTEX.get(platform.machine())
        if nr is None:
            raise SystemExit(f"no futex syscall number known for {platform.machine()}; run without futex modes")
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._syscall.argtypes = [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        self.nr = nr
        self._timeout = Timespec(0, int(FLAG_TIMEOUT_S * 1e9))

    def wait(self, addr: int, expected: int, timed: bool = False) -> bool:
        """Sleep while the word at ``addr`` holds ``expected``; False when it timed out."""
        timeout = ctypes.byref(self._timeout) if timed else None
        r = self._syscall(self.nr, addr, FUTEX_WAIT, expected, timeout, None, 0)
        return not (r < 0 and ctypes.get_errno() == 110)  # ETIMEDOUT

    def wake(self, addr: int) -> None:
        self._syscall(self.nr, addr, FUTEX_WAKE, 1, None, None, 0)


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Words:
    """The shared region: per env a request word, a reply word and two "sleeping" flags."""

    def __init__(self, n: int):
        fd = os.memfd_create("wakeups", 0)
        os.ftruncate(fd, n * SLOT)
        self.map = mmap.mmap(fd, n * SLOT, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.req = [ctypes.c_uint32.from_buffer(self.map, i * SLOT + REQ) for i in range(n)]
        self.rep = [ctypes.c_uint32.from_buffer(self.map, i * SLOT + REP) for i in range(n)]
        self.env_sleeps = [ctypes.c_uint32.from_buffer(self.map, i * SLOT + ENV_SLEEPS) for i in range(n)]
        self.trainer_sleeps = [ctypes.c_uint32.from_buffer(self.map, i * SLOT + TRAINER_SLEEPS) for i in range(n)]

    def close(self) -> None:
        # Dropped, not closed: the ctypes views export the buffer, and mmap.close() refuses while
        # any lives; the mapping goes with the last of them.
        del self.req, self.rep, self.env_sleeps, self.trainer_sleeps, self.map


def wait_word(futex: Futex, word, old: int, spin_s: float, flag=None, counts: list | None = None) -> int:
    """Wait until ``word`` no longer holds ``old``: spin ``spin_s`` seconds, then sleep in the
    kernel (with ``flag`` raised while asleep, when the writer wakes only sleepers); its new value."""
    v = word.value
    if v != old:
        return v
    if spin_s > 0:
        clock = time.perf_counter
        end = clock() + spin_s
        while v == old and clock() < end:
            v = word.value
    addr = ctypes.addressof(word)
    while v == old:
        if flag is None:
            futex.wait(addr, old)
        else:
            flag.value = 1
            woke = futex.wait(addr, old, timed=True)
            flag.value = 0
            if not woke and counts is not None and word.value != old:
                counts[0] += 1  # the writer missed our flag: a lost wake-up, rescued by the timeout
        v = word.value
    return v


# --------------------------------------------------------------------------- env processes
def env_pipe(req_r: int, rep_w: int) -> None:
    while os.read(req_r, 4096):
        os.write(rep_w, REPLY)


def env_eventfd(req: int, rep: int) -> None:
    while os.eventfd_read(req) == 1:
        os.eventfd_write(rep, 1)


def env_futex(words: Words, i: int, spin_s: float, flagged: bool) -> None:
    futex = Futex()
    req, rep = words.req[i], words.rep[i]
    flag = words.env_sleeps[i] if flagged else None
    trainer_sleeps = words.trainer_sleeps[i]
    rep_addr = ctypes.addressof(rep)
    last = 0
    while True:
        last = wait_word(futex, req, last, spin_s, flag)
        if last == STOP:
            return
        rep.value = last
        if not flagged or trainer_sleeps.value:
            futex.wake(rep_addr)


def env_batch(req_r: int, rep_w: int) -> None:
    rfile = os.fdopen(req_r, "rb", buffering=65536)
    for line in rfile:
        n = line.count(b",")  # '{"op":"step","actions":[1,1]}': one comma per env
        os.write(rep_w, b"[" + b",".join([REPLY[:-1]] * n) + b"]\n")


#: The trainer's ends of the envs' pipes so far: a forked env closes them, or an env would hold the
#: pipes of those forked before it open, and none of them would see its end of file.
_TRAINER_FDS: list[int] = []


def fork_env(target, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops us
            for fd in _TRAINER_FDS:
                os.close(fd)
            target(*args)
        except BaseException:  # noqa: BLE001 - a child must never return into the trainer's code
            code = 1
        os._exit(code)
    return pid


# --------------------------------------------------------------------------- trainer side
class Mechanism:
    """N env processes and the trainer's side of one batch (``batch()``)."""

    pids: list[int]
    lost = 0

    def batch(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class Pipes(Mechanism):
    def __init__(self, n: int):
        self.req_w, self.rep_r, self.pids = [], [], []
        self.epoll = select.epoll()
        for _ in range(n):
            req_r, req_w = os.pipe()
            rep_r, rep_w = os.pipe()
            pid = fork_env(env_pipe, req_r, rep_w)
            os.close(req_r)
            os.close(rep_w)
            os.set_blocking(rep_r, False)  # as the lane's are
            self.req_w.append(req_w)
            self.rep_r.append(rep_r)
            _TRAINER_FDS.extend((req_w, rep_r))
            self.pids.append(pid)
            self.epoll.register(rep_r, select.EPOLLIN)

    def batch(self) -> None:
        for fd in self.req_w:
            os.write(fd, REQUEST)
        pending = len(self.req_w)
        poll, read = self.epoll.poll, os.read
        while pending:
            for fd, _ in poll():
                read(fd, 65536)
                pending -= 1

    def stop(self) -> None:
        for fd in self.req_w + self.rep_r:
            os.close(fd)
        _TRAINER_FDS.clear()
        self.epoll.close()


class EventFds(Mechanism):
    def __init__(self, n: int):
        self.req, self.rep, self.pids = [], [], []
        self.epoll = select.epoll()
        for _ in range(n):
            req, rep = os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)
            self.pids.append(fork_env(env_eventfd, req, rep))
            self.req.append(req)
            self.rep.append(rep)
            _TRAINER_FDS.append(rep)
            self.epoll.register(rep, select.EPOLLIN)

    def batch(self) -> None:
        for fd in self.req:
            os.eventfd_write(fd, 1)
        pending = len(self.req)
        poll, read = self.epoll.poll, os.eventfd_read
        while pending:
            for fd, _ in poll():
                read(fd)
                pending -= 1

    def stop(self) -> None:
        for fd in self.req:
            os.eventfd_write(fd, 1000)  # anything but 1: stop
        for fd in self.req + self.rep:
            os.close(fd)
        _TRAINER_FDS.clear()
        self.epoll.close()


class Futexes(Mechanism):
    def __init__(self, n: int, spin_us: float, env_spin_us: float, flagged: bool):
        self.futex = Futex()
        self.words = Words(n)
        self.spin_s, self.flagged = spin_us * 1e-6, flagged
        self.seq = 0
        self.pids = [fork_env(env_futex, self.words, i, env_spin_us * 1e-6, flagged) for i in range(n)]
        self.req_addr = [ctypes.addressof(w) for w in self.words.req]
        self.counts = [0]

    def batch(self) -> None:
        self.seq = seq = self.seq + 1
        words, wake = self.words, self.futex.wake
        flagged = self.flagged
        for i, word in enumerate(words.req):
            word.value = seq
            if not flagged or words.env_sleeps[i].value:
                wake(self.req_addr[i])
        rep = words.rep
        pending = range(len(rep))
        if self.spin_s > 0:
            clock = time.perf_counter
            end = clock() + self.spin_s
            while pending and clock() < end:
                pending = [i for i in pending if rep[i].value != seq]
        for i in pending:
            flag = words.trainer_sleeps[i] if flagged else None
            wait_word(self.futex, rep[i], seq - 1, 0.0, flag, self.counts)
        self.lost = self.counts[0]

    def stop(self) -> None:
        for i, word in enumerate(self.words.req):
            word.value = STOP
            self.futex.wake(self.req_addr[i])
        for pid in self.pids:
            os.waitpid(pid, 0)
        self.pids = []
        self.words.close()


class Batch(Mechanism):
    def __init__(self, n: int):
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.pids = [fork_env(env_batch, req_r, rep_w)]
        os.close(req_r)
        os.close(rep_w)
        self.request = b'{"op":"step","actions":[' + b",".join([b"1"] * n) + b"]}\n"
        self.epoll = select.epoll()
        self.epoll.register(self.rep_r, select.EPOLLIN)
        self.buf = bytearray()

    def batch(self) -> None:
        os.write(self.req_w, self.request)
        while True:
            self.epoll.poll()
            self.buf += os.read(self.rep_r, 65536)  # as much as a pipe holds, as the other mechanisms read
            if self.buf.endswith(b"\n"):
                break
        self.buf.clear()

    def stop(self) -> None:
        os.close(self.req_w)
        os.close(self.rep_r)
        self.epoll.close()


def make(mode: str, n: int) -> Mechanism:
    if mode == "pipe":
        return Pipes(n)
    if mode == "eventfd":
        return EventFds(n)
    if mode == "batch":
        return Batch(n)
    for prefix, flagged, envs_spin in (("futexflag", True, True), ("futexT", False, False), ("futex", False, True)):
        if mode.startswith(prefix):
            spin = float(mode[len(prefix) :])
            return Futexes(n, spin, spin if envs_spin else 0.0, flagged)
    raise SystemExit(
        f"unknown mode {mode!r}: pipe, eventfd, futexS, futexTS, futexflagS (S = spin microseconds), batch"
    )


# --------------------------------------------------------------------------- measurement
def cpu_ns(pid: int | str) -> int:
    """Nanoseconds of CPU ``pid`` has used (``/proc/<pid>/schedstat``)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def switches(pid: int | str) -> tuple[int, int]:
    """``(voluntary, involuntary)`` context switches of ``pid`` (its main thread) so far; zeros once it is gone."""
    vol = invol = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
    except OSError:
        pass
    return vol, invol


def sample(pids: list[int]) -> tuple[int, int, int, int, int, int]:
    """CPU ns and switches (trainer, envs): ``(t_cpu, t_vol, t_invol, e_cpu, e_vol, e_invol)``."""
    t_vol, t_invol = switches("self")
    e_cpu = e_vol = e_invol = 0
    for pid in pids:
        e_cpu += cpu_ns(pid)
        v, i = switches(pid)
        e_vol += v
        e_invol += i
    return cpu_ns("self"), t_vol, t_invol, e_cpu, e_vol, e_invol


def run_block(mode: str, n: int, seconds: float, warmup: int, gap_s: float = 0.0) -> dict:
    """Start ``mode``'s envs, warm up, time batches for about ``seconds`` (``gap_s`` asleep before
    each, untimed), stop; the raw figures."""
    mech = make(mode, n)
    try:
        for _ in range(warmup):
            mech.batch()
        lat: list[float] = []
        clock = time.perf_counter
        before = sample(mech.pids)
        end = clock() + seconds
        while clock() < end or len(lat) < 20:
            if gap_s:
                time.sleep(gap_s)
            t = clock()
            mech.batch()
            lat.append(clock() - t)
        after = sample(mech.pids)
        lost = mech.lost
    finally:
        mech.stop()
        reap(mech.pids)
    delta = [a - b for a, b in zip(after, before)]
    return {"lat": lat, "delta": delta, "batches": len(lat), "lost": lost}


def reap(pids: list[int]) -> None:
    """Wait for every env of a block (they exit on EOF or STOP; killed after 5 s)."""
    deadline = time.monotonic() + 5.0
    for pid in pids:
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.001)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(blocks: list[dict]) -> dict:
    lat = [x for b in blocks for x in b["lat"]]
    batches = sum(b["batches"] for b in blocks)
    total = [sum(b["delta"][k] for b in blocks) for k in range(6)]
    t_cpu, t_vol, t_invol, e_cpu, e_vol, e_invol = (x / batches for x in total)
    return {
        "median_us": statistics.median(lat) * 1e6,
        "p90_us": percentile(lat, 0.9) * 1e6,
        "trainer_cpu_us": t_cpu / 1e3,
        "env_cpu_us": e_cpu / 1e3,
        "trainer_vol": t_vol,
        "trainer_invol": t_invol,
        "env_vol": e_vol,
        "env_invol": e_invol,
        "batches": batches,
        "lost": sum(b["lost"] for b in blocks),
    }


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def leftover_children() -> list[str]:
    """Processes whose parent is this one (there should be none once every block is reaped)."""
    out = subprocess.run(["ps", "-o", "pid=,cmd=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "ps -o" not in line]


def call_costs(calls: int = 100_000) -> list[tuple[str, float]]:
    """CPU microseconds per call of each mechanism's system calls, in one process, nobody waiting:
    what a wake-up costs before any context switch."""
    futex, words = Futex(), Words(1)
    word = words.req[0]
    addr = ctypes.addressof(word)
    r, w = os.pipe()
    os.set_blocking(r, False)
    efd = os.eventfd(0)

    def pipe_pair() -> None:
        os.write(w, REQUEST)
        os.read(r, 4096)

    def eventfd_pair() -> None:
        os.eventfd_write(efd, 1)
        os.eventfd_read(efd)

    def futex_wake() -> None:
        futex.wake(addr)

    def futex_wait_changed() -> None:
        futex.wait(addr, 1)  # the word holds 0: returns at once (EAGAIN)

    def word_read() -> None:
        word.value  # noqa: B018 - the load is what is timed

    out = []
    try:
        for label, fn in (
            ("pipe: os.write of a request line + os.read of it", pipe_pair),
            ("eventfd: os.eventfd_write + os.eventfd_read", eventfd_pair),
            ("futex: FUTEX_WAKE of a shared word (ctypes), nobody asleep", futex_wake),
            ("futex: FUTEX_WAIT on a word that already changed (ctypes)", futex_wait_changed),
            ("a spin's load: ctypes c_uint32.value", word_read),
        ):
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            out.append((label, (time.thread_time() - t0) / calls * 1e6))
    finally:
        for fd in (r, w, efd):
            os.close(fd)
        words.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,8,64")
    parser.add_argument(
        "--modes", default="pipe,eventfd,futex0,futex2,futex20,futex100,futexT20,futexT100,futexflag20,batch"
    )
    parser.add_argument("--rounds", type=int, default=3, help="blocks per mechanism, in rotating order")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per block")
    parser.add_argument("--warmup", type=int, default=20, help="untimed batches before each block")
    parser.add_argument(
        "--gap-us",
        type=float,
        default=0.0,
        help="the trainer sleeps this long before each batch (its policy's time), untimed",
    )
    parser.add_argument("--calls", action="store_true", help="only time each mechanism's calls in one process")
    args = parser.parse_args(argv)
    if args.calls:
        date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        print(f"CPU per call, one process, nobody waiting: {date}, {os.cpu_count()} CPUs; load: `{uptime()}`\n")
        print("| call | CPU per call (us), incl. the Python loop |\n|---|---:|")
        for label, us in call_costs():
            print(f"| {label} | {us:.2f} |")
        return 0
    modes = args.modes.split(",")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = uptime()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        blocks: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.rounds):
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                blocks[mode].append(run_block(mode, n, args.seconds, args.warmup, args.gap_us * 1e-6))
                print(f"  n={n} round {r} {mode}: {blocks[mode][-1]['batches']} batches", file=sys.stderr, flush=True)
        base = summarize(blocks["pipe"]) if "pipe" in blocks else None
        for mode in modes:
            rows.append((n, mode, summarize(blocks[mode]), base))
    print(f"wake-ups per batch: {started}, {os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}")
    print(f"trainer asleep {args.gap_us:g} us before each batch; {args.rounds} rounds of {args.seconds:g} s")
    print(f"load before: `{load_before}`; after: `{uptime()}`\n")
    print(
        "| N | mechanism | latency median (us) | p90 (us) | median / pipe | CPU/batch trainer (us) | envs (us) "
        "| total (us) | total / pipe | switches/batch trainer vol+invol | envs vol+invol | batches | lost |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for n, mode, s, base in rows:
        total = s["trainer_cpu_us"] + s["env_cpu_us"]
        rel = total / (base["trainer_cpu_us"] + base["env_cpu_us"]) if base else float("nan")
        lat_rel = s["median_us"] / base["median_us"] if base else float("nan")
        print(
            f"| {n} | {mode} | {s['median_us']:.0f} | {s['p90_us']:.0f} | {lat_rel:.2f} | {s['trainer_cpu_us']:.0f} "
            f"| {s['env_cpu_us']:.0f} | {total:.0f} | {rel:.2f} "
            f"| {s['trainer_vol']:.1f}+{s['trainer_invol']:.1f} | {s['env_vol']:.1f}+{s['env_invol']:.1f} "
            f"| {s['batches']} | {s['lost'] if mode.startswith('futexflag') else '-'} |",
            flush=True,
        )
    left = leftover_children()
    print(f"\nchildren left after the run: {len(left)}" + ("".join(f"\n  {x}" for x in left)))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
