"""Observability: /metrics scraped over real HTTP while real pools fail on purpose,
``top --once`` against ``pool.stats()``, the port-in-use and missing-extra errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from boltzlabs_gym import Limits, MetricsPortError, MissingExtraError, RLPool

from conftest import ENVS, FAULTY, ISOLATION

pytest.importorskip("prometheus_client")
pytest.importorskip("rich")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")

SANDBOXED = os.path.join(ENVS, "sandboxed")


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` as {(sample name, labels without worker): value}, read with a real HTTP client."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "worker")
            out[(sample.name, labels)] = sample.value
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def oom_detectable() -> bool:
    """Whether the sandbox here puts envs in a memory cgroup (the OOM killer is then told apart)."""
    from boltzlabs_gym.worker.sandbox import select_backend

    return "cgroup" in str(select_backend(ISOLATION).report().properties.get("memory_limit"))


def top_once(*addresses: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "boltzlabs_gym.cli", "top", "--once", *addresses],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def top_row(text: str, session: str) -> list[str]:
    """The cells of ``session``'s row in a ``top --once`` frame."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) > 2 and cells[1] == session:
            return cells
    raise AssertionError(f"no row for {session} in\n{text}")


@pytest.fixture
def faulty_pool():
    limits = Limits(memory_bytes=192 << 20)
    with RLPool(FAULTY, n=6, isolation=ISOLATION, step_timeout=1.0, limits=limits, metrics_port=0) as pool:
        yield pool


def test_every_counter_moves_by_the_injected_faults_and_top_agrees_with_pool_stats(faulty_pool):
    pool = faulty_pool
    assert pool.metrics_url and pool.metrics_url.startswith("http://127.0.0.1:")
    pool.reset(seed=0)
    pool.stats(memory=False)  # the lane's steps reported: the worker's books are current
    before = scrape(pool.metrics_url)
    oom = oom_detectable()
    # Without a memory cgroup an allocation past the limit is a MemoryError, not a kill: no OOM then.
    actions = [{"hang": True}, {"crash": True}, {"exit": 7}, {"garbage": True}, {"alloc_mib": 1024} if oom else 1, 1]
    obs, rewards, dones, infos = pool.step(actions)
    assert "boltzlabs_straggler" in infos[0] and all("boltzlabs_error" in infos[i] for i in range(1, 4 + oom))
    pool.reset(hard=True, where=np.array([False, False, False, False, False, True]))
    stats = pool.stats(memory=False)
    after = scrape(pool.metrics_url)

    assert delta(before, after, "boltzlabs_stragglers_total", session="s1", reason="deadline") == 1
    assert delta(before, after, "boltzlabs_crashes_total", session="s1", reason="signal") == 1
    assert delta(before, after, "boltzlabs_crashes_total", session="s1", reason="exit") == 1
    assert delta(before, after, "boltzlabs_crashes_total", session="s1", reason="bad_reply") == 1
    assert delta(before, after, "boltzlabs_bad_replies_total", session="s1", reason="malformed") == 1
    if oom:
        assert delta(before, after, "boltzlabs_crashes_total", session="s1", reason="oom") == 1
        assert delta(before, after, "boltzlabs_oom_kills_total", session="s1") == 1
    crashes = sum(delta(before, after, "boltzlabs_crashes_total", session="s1", reason=r) for r in _reasons(after))
    assert crashes == 3 + oom == stats.errors
    for reason in ("straggler", "signal", "exit", "bad_reply", *(["oom"] if oom else [])):
        assert delta(before, after, "boltzlabs_respawns_total", session="s1", reason=reason) == 1, reason
    assert delta(before, after, "boltzlabs_hard_resets_total", session="s1") == 1
    calls = sum(value(after, "boltzlabs_env_calls_total", session="s1", route=r) for r in ("worker", "lane"))
    assert calls == stats.calls
    assert value(after, "boltzlabs_uploads_total", result="unpacked") == 1
    assert value(after, "boltzlabs_envs_per_gib", session="s1") > 0
    assert value(after, "boltzlabs_session_info", session="s1", mode="default", envs_per_sandbox="1",
                 isolation=pool.isolation.backend) == 1  # fmt: skip
    assert value(after, "boltzlabs_auth_failures_total") == 0
    check_top_once_against_pool_stats(pool)


def _reasons(metrics: dict) -> set[str]:
    return {dict(labels)["reason"] for name, labels in metrics if name == "boltzlabs_crashes_total"}


def check_top_once_against_pool_stats(pool):
    pool.step([1] * pool.n)
    stats = pool.stats()
    cells = top_row(top_once(pool.workers[0]), "s1")
    headings = ["worker", "session", "envs", "state", "env calls", "calls/s", "batch", "env step", "stragglers",
                "crashes", "PSS", "envs/GiB", "isolation"]  # fmt: skip
    row = dict(zip(headings, cells))
    assert row["envs"] == str(stats.n)
    assert row["env calls"] == str(stats.calls)
    assert row["stragglers"].endswith(f"({stats.stragglers})") and row["stragglers"].startswith(str(stats.stragglers_1m))
    assert row["crashes"].endswith(f"({stats.errors})") and row["crashes"].startswith(str(stats.errors_1m))
    assert row["isolation"] == stats.isolation
    assert abs(int(row["envs/GiB"]) - stats.envs_per_gib) <= max(2.0, 0.2 * stats.envs_per_gib)


def test_worker_routed_steps_sample_env_latency_and_count_envs_of_sandboxes():
    with RLPool(SANDBOXED, n=4, isolation=ISOLATION, envs_per_sandbox=2, direct=False, metrics_port=0) as pool:
        pool.reset(seed=0)
        for _ in range(40):
            pool.step([1] * 4)
        stats = pool.stats(memory=False)
        metrics = scrape(pool.metrics_url)
        envs = {dict(labels)["state"]: v for (name, labels), v in metrics.items() if name == "boltzlabs_envs"}
        assert sum(envs.values()) == 4  # envs, not the 2 sandboxes
        assert value(metrics, "boltzlabs_sandboxes_in_use") == 2
        assert value(metrics, "boltzlabs_env_calls_total", session="s1", route="worker") == stats.calls == 4 * 41
        assert value(metrics, "boltzlabs_batch_latency_seconds_count", session="s1", route="worker") == 41
        assert value(metrics, "boltzlabs_env_step_latency_seconds_count", session="s1") >= 1  # sampled
        assert value(metrics, "boltzlabs_env_start_seconds_count", session="s1") == 2  # sandboxes started
        assert any(name == "boltzlabs_session_info" and ("envs_per_sandbox", "2") in labels for name, labels in metrics)


def test_metrics_port_in_use_is_refused_with_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"metrics_port {port} .* not free") as info:
            RLPool(FAULTY, n=1, isolation=ISOLATION, metrics_port=port)
        assert isinstance(info.value, OSError) and info.value.port == port
        done = subprocess.run(
            [sys.executable, "-m", "boltzlabs_gym.worker", "--bind", "tcp://127.0.0.1:0", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 2
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in done.stderr and "choose another" in done.stderr


def test_without_the_metrics_extra_the_error_names_it(monkeypatch, capsys):
    from boltzlabs_gym import cli

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "rich", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'boltzlabs-gym\[metrics\]'"):
        RLPool(FAULTY, n=1, isolation=ISOLATION, metrics_port=0)
    # Not cli.main(): it restores SIGPIPE's default, which would turn the direct lane off for
    # every later pool of this test process.
    args = cli.build_parser().parse_args(["top", "--once", "ipc:///nonexistent"])
    assert args.func(args) == 2
    assert "boltzlabs-gym[metrics]" in capsys.readouterr().err


def test_a_dead_worker_is_a_row_not_a_crash():
    started = time.monotonic()
    text = top_once("tcp://127.0.0.1:9")  # discard port: nobody answers
    assert "unreachable" in text and time.monotonic() - started < 20


def test_slow_envs_are_sampled_as_often_as_fast_ones():
    """Which calls are sampled is decided when they are sent, so the slow envs of a batch, which
    answer last, are in the env-step histogram as often as the rest."""
    with RLPool(FAULTY, n=16, isolation=ISOLATION, direct=False, metrics_port=0) as pool:
        pool.reset()
        slow = {"sleep": 0.02}
        for _ in range(60):
            pool.step([slow, slow] + [1] * 14)
        live = pool._links[0].call({"op": "status"}, timeout=30)["sessions"][0]["live"]
        assert live["env_step_p99_ms"] >= 15, live  # 1 step in 8 takes 20 ms
        assert live["env_step_p50_ms"] < 15, live


def test_a_lane_call_that_fails_is_counted_once():
    with RLPool(FAULTY, n=4, isolation=ISOLATION, metrics_port=0) as pool:
        pool.reset()
        pool.step([1] * 4)
        time.sleep(1.2)  # the next send carries the lane's report (once a second)
        pool.step([{"exit": 3}, 1, 1, 1])
        stats = pool.stats(memory=False)
        live = pool._links[0].call({"op": "status"}, timeout=30)["sessions"][0]["live"]
        assert live["calls"] == stats.calls == pool.timing.env_steps == 12, (live, stats)
