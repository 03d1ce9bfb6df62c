"""``boltzlabs-gym top``: a live table of what every session on some workers is doing.

It asks each worker for its ``status`` (the same op as ``boltzlabs-gym status``: no
Prometheus server needed) and draws one row per session with ``rich``: envs and their
state, env calls per second, batch latency p50/p99, sampled env-step latency p50/p99,
stragglers and crashes in the last minute (totals beside them), PSS and isolation.
``--once`` prints one frame and exits, for scripts and CI logs.

The figures come from the worker's books (:mod:`boltzlabs_gym.worker.stats`): a local
pool's steps on its direct lane arrive there once a second (and at each ``pool.stats()``).

>>> rows = session_rows([("ipc://w", {"ok": True, "sessions": [{"session": "s1", "envs": 4,
...     "envs_per_sandbox": 1, "envs_by_state": {"lent": 3, "dead": 1}, "pss_bytes": 2**30,
...     "template_pss_bytes": 0, "envs_per_gib": 4.0, "isolation": {"backend": "namespaces"},
...     "live": {"calls_per_s": 100.0, "stragglers_1m": 1, "stragglers": 2, "crashes_1m": 0,
...              "crashes": 0, "batch_p50_ms": 1.5, "batch_p99_ms": 3.0}}]})])
>>> rows[0]["envs"], rows[0]["state"], rows[0]["stragglers"], rows[0]["pss"]
('4', 'lent 3, dead 1', '1 (2)', '1024 MiB')
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..extras import require

__all__ = ["COLUMNS", "fetch_status", "render", "run_top", "session_rows"]

#: (key, heading) of each column, in order.
COLUMNS = (
    ("worker", "worker"),
    ("session", "session"),
    ("envs", "envs"),
    ("state", "state"),
    ("calls", "env calls"),
    ("calls_per_s", "calls/s"),
    ("batch_ms", "batch p50/p99 ms"),
    ("env_ms", "env step p50/p99 ms"),
    ("stragglers", "stragglers 1m (all)"),
    ("crashes", "crashes 1m (all)"),
    ("pss", "PSS"),
    ("envs_per_gib", "envs/GiB"),
    ("isolation", "isolation"),
)


def fetch_status(address: str, keys: str | None = None, timeout: float = 5.0) -> dict:
    """One worker's ``status`` reply; ``{"ok": False, "error": ...}`` if it does not answer."""
    import zmq

    from ..wire.protocol import decode_header, encode_header

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys:
            from ..wire.keys import load_client_keys

            client = load_client_keys(keys)
            sock.curve_secretkey = client.secret
            sock.curve_publickey = client.public
            sock.curve_serverkey = client.server_public
        sock.connect(address)
        sock.send_multipart([encode_header({"op": "status", "seq": 1})])
        if not sock.poll(int(timeout * 1000)):
            return {"ok": False, "error": f"no answer within {timeout:g} s"}
        return decode_header(sock.recv_multipart()[0])
    finally:
        sock.close(0)
        ctx.term()


def _pair(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{a:.2f} / {b:.2f}"


def session_rows(statuses: Sequence[tuple[str, dict]]) -> list[dict[str, str]]:
    """One row of :data:`COLUMNS` texts per session of each ``(address, status reply)``."""
    rows = []
    for address, status in statuses:
        if not status.get("ok"):
            error = status.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            rows.append({"worker": address, "session": "-", "state": f"unreachable: {message}"})
            continue
        if not status.get("sessions"):
            rows.append({"worker": address, "session": "-", "state": f"no sessions ({status.get('free', '?')} free)"})
        for s in status.get("sessions", []):
            live: dict[str, Any] = s.get("live") or {}
            states = s.get("envs_by_state") or {}
            k = s.get("envs_per_sandbox", 1)
            pss = (s.get("pss_bytes") or 0) + (s.get("template_pss_bytes") or 0)
            rows.append(
                {
                    "worker": address,
                    "session": str(s.get("session")),
                    "envs": f"{s.get('envs')}" + (f" ({k}/sandbox)" if k > 1 else ""),
                    "state": ", ".join(f"{name} {count}" for name, count in states.items() if count),
                    "calls": str(live.get("calls", 0)),
                    "calls_per_s": f"{live.get('calls_per_s', 0.0):.0f}",
                    "batch_ms": _pair(live.get("batch_p50_ms"), live.get("batch_p99_ms")),
                    "env_ms": _pair(live.get("env_step_p50_ms"), live.get("env_step_p99_ms")),
                    "stragglers": f"{live.get('stragglers_1m', 0)} ({live.get('stragglers', 0)})",
                    "crashes": f"{live.get('crashes_1m', 0)} ({live.get('crashes', 0)})",
                    "pss": f"{pss / 2**20:.0f} MiB",
                    "envs_per_gib": f"{s['envs_per_gib']:.0f}" if s.get("envs_per_gib") else "-",
                    "isolation": str((s.get("isolation") or {}).get("backend", "?")),
                }
            )
    return rows


def render(statuses: Sequence[tuple[str, dict]]):
    """A ``rich`` table of :func:`session_rows`; stragglers and crashes in the last minute in red."""
    require("rich", "metrics", "boltzlabs-gym top")
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"boltzlabs-gym top  {time.strftime('%H:%M:%S')}", title_justify="left")
    for key, heading in COLUMNS:
        table.add_column(heading, justify="right" if key not in ("worker", "session", "state", "isolation") else "left")
    for row in session_rows(statuses):
        cells = []
        for key, _ in COLUMNS:
            text = escape(row.get(key, ""))  # what a worker says is text, never markup
            if key in ("stragglers", "crashes") and text and not text.startswith("0 "):
                text = f"[bold red]{text}[/]"
            cells.append(text)
        table.add_row(*cells)
    return table


def run_top(addresses: Sequence[str], keys: str | None, once: bool, interval: float, timeout: float) -> int:
    """Draw the table for ``addresses`` every ``interval`` seconds until Ctrl-C (``once``: one frame)."""
    require("rich", "metrics", "boltzlabs-gym top")
    from rich.console import Console
    from rich.live import Live

    def frame():
        return render([(a, fetch_status(a, keys, timeout)) for a in addresses])

    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide enough for a whole row, no wrapping
        console = Console(width=240)
    if once:
        console.print(frame(), soft_wrap=False)
        return 0
    try:
        with Live(frame(), console=console, screen=False, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0
