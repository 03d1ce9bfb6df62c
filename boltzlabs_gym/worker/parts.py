"""What the parts of :class:`~boltzlabs_gym.worker.server.Worker` share.

The worker is one object made of parts, one module each (see :mod:`.server`): this base
declares the state they share, which ``Worker.__init__`` sets, and the methods one part
calls in another, which live in that part. The declarations are for readers and the type
checker only: at run time nothing here exists but the class itself.
"""

from __future__ import annotations

import collections
import select
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .deadlines import Deadlines
from .envproc import Call, EnvProcess
from .session import Batch, Session
from .snapshot_store import SnapshotStore
from .stats import WorkerStats

if TYPE_CHECKING:
    from ..wire.channel import WorkerChannel


class WorkerParts:
    """The state and cross-part methods every part of :class:`Worker` may use."""

    # ------------------------------------------------------------------ state (set by Worker.__init__)
    sessions: dict[str, Session]
    snapshots: SnapshotStore
    stats: WorkerStats
    metrics_url: str | None
    endpoints: list[str]
    epoll: select.epoll
    runtime: dict[str, str]
    max_starting: int
    _local: WorkerChannel | None
    _current_user: str | None
    _deadlines: Deadlines
    _tokens: collections.abc.Iterator[int]
    _fd_owner: dict[int, tuple[EnvProcess, str]]
    _gate_busy: bool
    _gate_waiters: collections.deque[tuple[Session, EnvProcess]]
    _start_queue: collections.deque[tuple[Session, EnvProcess]]
    _starting: int
    _in_start_more: bool
    _to_reap: set[int]
    _exit_status: dict[int, int]

    if TYPE_CHECKING:
        # ---------------------------------------------------------------- the loop (server.py)
        def _send(self, client: bytes, header: dict, frames: Sequence = (), fds: Sequence[int] = ()) -> None: ...
        def _reply_batch(self, batch: Batch) -> None: ...
        def _session_for(self, client: bytes, header: dict) -> Session: ...
        def _drain_clients(self) -> None: ...
        def _register_env(self, env: EnvProcess) -> None: ...
        def _unregister(self, fd: int) -> None: ...
        def _close_session(self, session: Session) -> None: ...

        # ---------------------------------------------------------------- scheduling.py
        def _submit(
            self, session: Session, env: EnvProcess, op: dict, frames: Sequence[bytes], batch: Batch, pos: int
        ) -> None: ...
        def _send_call(self, session: Session, env: EnvProcess, call: Call) -> None: ...
        def _fault(self, session: Session, env: EnvProcess, reason: str, *, straggler: bool = False) -> None: ...
        def _in_flight(self, key: tuple) -> bool: ...
        def _start_failed(self, session: Session, env: EnvProcess, call: Call, reason: str) -> None: ...

        # ---------------------------------------------------------------- lender.py
        def _may_lend(self, client: bytes, session: Session) -> bool: ...
        def _apply_lent_reports(self, client: bytes, session: Session, header: dict) -> None: ...
        def _send_lending(self, session: Session, header: dict, frames: list) -> None: ...
        def _take_back(self, env: EnvProcess) -> None: ...
        def _submit_lent_fault(self, session: Session, env: EnvProcess, op: dict, batch: Batch, pos: int) -> None: ...

        # ---------------------------------------------------------------- spawner.py
        def _queue_start(
            self, session: Session, env: EnvProcess, call: Call | None, reset_op: dict | None = None
        ) -> None: ...
        def _start_more(self) -> None: ...
        def _kill_and_explain(self, session: Session, env: EnvProcess, reason: str, straggler: bool) -> str: ...
        def _kill_env(self, session: Session, env: EnvProcess) -> int | None: ...
        def _reap_now(self, pid: int | None) -> int | None: ...
        def _wipe(self, path: str) -> None: ...
        def _replace_with_copies(self, session: Session, envs: list[EnvProcess], holder: Any) -> dict[int, str]: ...
