"""Markdown tables and PNG plots from a ``latest.json`` result (see run.py)."""

from __future__ import annotations

import os


def _fmt(x, spec=",.0f", none="-"):
    return none if x is None else format(x, spec)


def _ok(runs):
    return [r for r in runs if r.get("status") == "ok" and r.get("steps_per_s")]


def _floor(result, n):
    for r in _ok(result["floor"]):
        if r["n"] == n:
            return r
    return None


def _get(rows, name, n):
    return next(
        (r for r in rows if r["impl"] == name and r["n"] == n and r.get("status") == "ok" and r.get("steps_per_s")),
        None,
    )


def ratios(result, workload, n):
    """(best ours, best alternative (name, sps), floor sps) at one (workload, n)."""
    rows = [r for r in _ok(result["runs"]) if r["workload"] == workload and r["n"] == n]
    ours = [r for r in rows if r["ours"]]
    alts = [r for r in rows if not r["ours"]]
    best_ours = max(ours, key=lambda r: r["steps_per_s"], default=None)
    best_alt = max(alts, key=lambda r: r["steps_per_s"], default=None)
    fl = _floor(result, n)
    return best_ours, best_alt, fl


def markdown(result) -> str:
    m = result["machine"]
    L = []
    L.append(f"# Vector-env benchmark ({result['suite']} suite)\n")
    L.append(f"- date: {m['date']}, git {str(m.get('git_commit'))[:10]}")
    L.append(
        f"- machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['mem_total_bytes'] / 2**30:.1f} GiB RAM, "
        f"Python {m['python'].split()[0]}"
    )
    L.append("- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v))
    L.append(
        f"- load average (1/5/15 min) at start {_la(result['loadavg_start'])}, at end {_la(result['loadavg_end'])}"
        f" - the machine is shared, so figures are noisy; elapsed {result.get('elapsed_s', 0):.0f} s"
    )
    L.append(
        "- method: every implementation of a (workload, n) is started once (n <= "
        f"{result['config']['keep_alive_max_n']}; larger n: started per repetition), then each repetition runs one "
        "timed block per implementation, in alternating order; random actions, fixed seed. "
        "steps/s = n x batched steps / time, median over repetitions."
    )
    L.append(
        "- fan-out floor: n bare Python echo processes, one line written to each with os.write and read back via "
        "poll from one process; floor steps/s = n / (time of one fan-out). Nothing can step n envs in separate "
        "processes faster than this.\n"
    )

    for wl, desc in result["workloads"].items():
        rows = [r for r in result["runs"] if r["workload"] == wl]
        if not rows:
            continue
        ns = sorted({r["n"] for r in rows})
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        L.append(f"## {wl}: {desc}\n")
        L.append("Throughput, env-steps/s (higher is better)\n")
        L.append("| impl | " + " | ".join(f"n={n}" for n in ns) + " |")
        L.append("|---|" + "---:|" * len(ns))
        for name in impls:
            cells = []
            for n in ns:
                r = next((r for r in rows if r["impl"] == name and r["n"] == n), None)
                cells.append("-" if r is None else _fmt(r.get("steps_per_s")) if r["status"] == "ok" else r["status"])
            L.append(f"| {name} | " + " | ".join(cells) + " |")
        if wl != "code":
            L.append(
                "| *fan-out floor* | "
                + " | ".join(_fmt((_floor(result, n) or {}).get("steps_per_s")) for n in ns)
                + " |"
            )
        for oname in [i for i in impls if any(r["ours"] for r in rows if r["impl"] == i)]:
            for label, alt in (
                ("best alternative", None),
                ("SyncVectorEnv", "gym.SyncVectorEnv"),
                ("AsyncVectorEnv", "gym.AsyncVectorEnv(shm)"),
                ("SubprocVecEnv", "sb3.SubprocVecEnv"),
                ("fan-out floor", "floor"),
            ):
                if wl == "code" and alt is not None:
                    continue
                cells, any_cell = [], False
                for n in ns:
                    o = _get(rows, oname, n)
                    _, best, fl = ratios(result, wl, n)
                    ref = best if alt is None else fl if alt == "floor" else _get(rows, alt, n)
                    if o and ref:
                        any_cell = True
                        cells.append(
                            f"{o['steps_per_s'] / ref['steps_per_s']:.2f}"
                            + (f" ({ref['impl']})" if alt is None else "")
                        )
                    else:
                        cells.append("-")
                if any_cell:
                    L.append(f"| **{oname} / {label}** | " + " | ".join(cells) + " |")
        L.append("")
        L.append(
            "Details per (impl, n): batched-step latency, start-up, memory; ours also worker_ms vs roundtrip_ms "
            "(medians)\n"
        )
        L.append(
            "| impl | n | lat median ms | lat p99 ms | start-up s | PSS/env MiB | envs/GiB | worker_ms | roundtrip_ms |"
        )
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(_ok(rows), key=lambda r: (r["n"], impls.index(r["impl"]))):
            pss = r.get("pss_per_env_bytes")
            L.append(
                f"| {r['impl']} | {r['n']} | {_fmt(r['latency_ms_median'], '.2f')} | {_fmt(r['latency_ms_p99'], '.2f')}"
                f" | {_fmt(r['startup_s_median'], '.2f')} | {_fmt(pss / 2**20 if pss else None, '.1f')}"
                f" | {_fmt(r.get('envs_per_gib'), ',.0f')} | {_fmt(r.get('worker_ms_median'), '.2f')}"
                f" | {_fmt(r.get('roundtrip_ms_median'), '.2f')} |"
            )
        L.append("")

    fl = _ok(result["floor"])
    if fl:
        L.append("## Fan-out floor\n")
        L.append("| n | fan-outs/s | steps/s | lat median ms | lat p99 ms | start-up s | PSS/proc MiB |")
        L.append("|---:|---:|---:|---:|---:|---:|---:|")
        for r in fl:
            L.append(
                f"| {r['n']} | {_fmt(r['steps_per_s'] / r['n'])} | {_fmt(r['steps_per_s'])} | "
                f"{_fmt(r['latency_ms_median'], '.3f')} | {_fmt(r['latency_ms_p99'], '.3f')} | "
                f"{_fmt(r['startup_s_median'], '.2f')} | {_fmt((r.get('pss_per_env_bytes') or 0) / 2**20, '.1f')} |"
            )
        L.append("")

    if result["hard_reset"]:
        L.append("## Hard reset (ours: `pool.reset(hard=True, where=<one env>)`)\n")
        L.append("| impl | workload | n | median ms | p99 ms |")
        L.append("|---|---|---:|---:|---:|")
        for r in result["hard_reset"]:
            L.append(
                f"| {r['impl']} | {r['workload']} | {r['n']} | {_fmt(r.get('hard_reset_ms_median'), '.1f')} | "
                f"{_fmt(r.get('hard_reset_ms_p99'), '.1f')} |" + ("" if r["status"] == "ok" else f" {r.get('reason')}")
            )
        L.append("")

    if result["straggler"]:
        L.append("## Straggler: one env wedged forever in a step\n")
        L.append("| impl | n | outcome | normal step ms | wedged step ms | recovery ms | notes |")
        L.append("|---|---:|---|---:|---:|---:|---|")
        for r in result["straggler"]:
            note = (
                r.get("detail")
                or r.get("reason")
                or (f"step_timeout={r['step_timeout_s']} s" if "step_timeout_s" in r else "")
            )
            L.append(
                f"| {r['impl']} | {r['n']} | {r.get('outcome', r['status'])} | "
                f"{_fmt(r.get('normal_step_ms'), '.2f')} | "
                f"{_fmt(r.get('straggler_step_ms'), '.0f')} | {_fmt(r.get('recovery_ms'), '.0f')} | {note} |"
            )
        L.append("")

    if result["skipped"]:
        L.append("## Skipped / failed\n")
        for s in result["skipped"]:
            L.append(f"- {s['impl']} ({s['workload']}): {s['status']}: {s['reason']}")
        L.append("")
    return "\n".join(L)


def _la(la):
    return "/".join(f"{x:.2f}" for x in la)


def plots(result, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    wls = [w for w in result["workloads"] if any(r["workload"] == w for r in _ok(result["runs"]))]
    fig, axes = plt.subplots(1, max(1, len(wls)), figsize=(5 * max(1, len(wls)), 4.2), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        rows = [r for r in _ok(result["runs"]) if r["workload"] == wl]
        for name in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["n"], r["steps_per_s"]) for r in rows if r["impl"] == name)
            style = (
                dict(lw=2.5, marker="o")
                if rows[[r["impl"] for r in rows].index(name)]["ours"]
                else dict(marker=".", lw=1.2)
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        if wl != "code":
            fl = sorted((r["n"], r["steps_per_s"]) for r in _ok(result["floor"]))
            if fl:
                ax.plot([p[0] for p in fl], [p[1] for p in fl], "k--", label="fan-out floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(wl)
        ax.set_xlabel("n envs")
        ax.set_ylabel("env-steps/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Throughput vs n ({result['suite']} suite, loadavg {_la(result['loadavg_start'])})")
    fig.tight_layout()
    p = os.path.join(out_dir, "throughput_vs_n.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mem = {}
    for r in _ok(result["runs"]) + _ok(result["floor"]):
        if r.get("envs_per_gib"):
            mem.setdefault(f"{r['impl']} [{r['workload']}]", []).append((r["n"], r["envs_per_gib"]))
    for name, pts in mem.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("n envs")
    ax.set_ylabel("envs per GiB (PSS)")
    ax.set_title("Memory density (PSS summed over worker process trees)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    p = os.path.join(out_dir, "envs_per_gib_vs_n.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
