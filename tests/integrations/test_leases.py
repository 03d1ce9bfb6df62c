"""EnvLeases: calls on different leases overlap (threads and coroutines), nothing is lost or crossed,
and a lease given back is killed and wiped."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from boltzlabs_gym.integrations.leases import EnvLeases

SLEEP = 1.0
# Prints its lease's token and when it ran (the wall clock: the same inside every sandbox).
TIMED = "import time\nstart = time.time()\ntime.sleep({sleep})\nprint({token!r}, start, time.time())\n"


@pytest.fixture(scope="module")
def four():
    with EnvLeases(4) as leases:
        yield leases


def _spans(results: dict, tokens: dict) -> list[tuple[float, float]]:
    spans = []
    for i, result in results.items():
        token, start, end = result.stdout.split()
        assert result.ok and token == tokens[i], result  # each got its own program's output
        spans.append((float(start), float(end)))
    return spans


def _all_ran_at_once(spans: list[tuple[float, float]]) -> bool:
    return max(s for s, _ in spans) < min(e for _, e in spans)


def test_threads_on_their_own_leases_run_at_once(four):
    leased = [four.acquire() for _ in range(4)]
    tokens = {i: f"lease-{i}" for i in leased}
    results: dict = {}

    def rollout(i: int) -> None:
        results[i] = four.run(i, TIMED.format(sleep=SLEEP, token=tokens[i]), run_timeout=10)

    threads = [threading.Thread(target=rollout, args=(i,)) for i in leased]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    assert _all_ran_at_once(_spans(results, tokens)), results
    assert took < 4 * SLEEP, f"4 x {SLEEP} s programs on 4 leases took {took:.2f} s: they ran one after another"
    for i in leased:
        four.release(i)
    assert four.leased == 0


def test_coroutines_on_their_own_leases_run_at_once_and_releases_wipe(four):
    async def rollout(i: int) -> tuple:
        first = await four.run_async(i, f"open('mine.txt', 'w').write('{i}')")
        timed = await four.run_async(i, TIMED.format(sleep=SLEEP, token=f"lease-{i}"), run_timeout=10)
        mine = await four.run_async(i, "print(open('mine.txt').read())")
        await four.release_async(i)
        return first, timed, mine

    async def main() -> list:
        leased = [four.acquire() for _ in range(4)]
        return list(zip(leased, await asyncio.gather(*(rollout(i) for i in leased))))

    done = asyncio.run(main())
    spans = _spans({i: timed for i, (_, timed, _) in done}, {i: f"lease-{i}" for i, _ in done})
    assert _all_ran_at_once(spans)
    for i, (first, _, mine) in done:
        assert first.ok and mine.stdout == f"{i}\n", mine  # its own file, not another lease's
    assert four.leased == 0


def test_a_lease_given_back_is_killed_and_wiped_and_one_lease_keeps_call_order(four):
    i = four.acquire()
    spawn = "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)\nopen('left.txt', 'w')\n"
    assert four.run(i, spawn).ok
    # Two threads on one lease: their programs run one after the other, never interleaved.
    logged = "import time\nopen('log', 'a').write('<{0} ')\ntime.sleep(0.3)\nopen('log', 'a').write('{0}> ')\n"
    threads = [threading.Thread(target=four.run, args=(i, logged.format(tag))) for tag in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert four.run(i, "print(open('log').read())").stdout.strip() in ("<a a> <b b>", "<b b> <a a>")
    four.release(i)
    others = [four.acquire() for _ in range(4)]  # the same env among them, now fresh
    check = (
        "import os\nprint(os.path.exists('left.txt'), any('sleep' in open(f'/proc/{p}/cmdline').read() "
        "for p in os.listdir('/proc') if p.isdigit()))"
    )
    for j in others:
        assert four.run(j, check).stdout == "False False\n"
        four.release(j)
