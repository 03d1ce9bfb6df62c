"""Memory snapshots, the worker's part: taking one (the env's swap with its held fork) and restoring
one (a copy forked from the holder into each slot).

:class:`Snapshotter` is a part of the worker. A snapshot item of a batch becomes a :class:`Swap`
here before the env is asked (the env's workspace copied, the budget checked, the continued
source's socket handed over), and the env's answer finishes it: the slot gets the continued
source, the worker's snapshot store the holder. A restore item's slot gets a copy of a holder
(:meth:`Snapshotter.replace_with_copies`), which then answers the restore like any env. The
launcher's side of both is :class:`~.launcher.SnapshotLauncher`; the env's,
:mod:`boltzlabs_gym.envside.memory_snapshot`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable

from ...wire.protocol import ERROR, MEMORY, OK, parse_json
from ..envproc import BUSY, DEAD, IDLE, QUEUED, STARTING, EnvProcess, json_error
from ..poller import Poller
from ..pss import pid_pss
from ..sandbox import LaunchSpec
from ..sandbox.base import Launched
from ..session import Session
from ..snapshot_store import SnapshotBudgetExceeded, SnapshotStore
from ..spawner import Spawner
from .gate import Gate
from .holders import Holder, copy_workspace
from .launcher import SnapshotLauncher

log = logging.getLogger("boltzlabs_gym.worker")

#: Why an env launcher that cannot copy its envs at all gives no memory snapshots.
NO_COPIES = "memory snapshots need the namespaces backend (a sandbox that can nest one per copy)"

#: An item's result, as an env's reply: status, reply line, payload frames.
Result = tuple[str, bytes, list]


class Swap:
    """A memory snapshot in the making: the env was asked to swap (its request carries ``nonce``);
    its answer finishes it (:meth:`Snapshotter.end_swap`)."""

    __slots__ = ("copies", "env", "sock", "workspace_copy", "workspace_bytes", "nonce")

    def __init__(
        self,
        copies: SnapshotLauncher,
        env: EnvProcess,
        sock: socket.socket,
        workspace_copy: str,
        workspace_bytes: int,
        nonce: str,
    ) -> None:
        self.copies, self.env, self.sock, self.nonce = copies, env, sock, nonce
        self.workspace_copy, self.workspace_bytes = workspace_copy, workspace_bytes


class Snapshotter:
    """The worker's memory snapshots: swaps, restores, and the launchers that make them.

    ``gate`` answers the envs' gated syscalls (given to each session's launcher); ``store`` holds
    the holders, within the worker's snapshot budget; ``spawner`` kills an env a copy replaces and
    starts a fresh one where a copy failed; ``poller`` watches the copies.
    """

    def __init__(self, gate: Gate, store: SnapshotStore, spawner: Spawner, poller: Poller) -> None:
        self.gate = gate
        self.store = store
        self.spawner = spawner
        self.poller = poller

    def copies_for(self, backend: object) -> SnapshotLauncher | None:
        """The memory-snapshot launcher for a session of ``backend``'s envs, or None when that backend
        cannot copy an env at all (boltz mode's template launcher makes its own: ``.copies``)."""
        why_not: Callable[[], str | None] | None = getattr(backend, "copies_unavailable", None)
        return SnapshotLauncher(self.gate, why_not) if why_not is not None else None

    # ================================================================== taking one
    def begin_swap(self, session: Session, env: EnvProcess) -> Swap | str:
        """Get ``env`` ready to take a memory snapshot: its swap, or why it cannot take one.
        :class:`SnapshotBudgetExceeded` when it would not fit (nothing changed then)."""
        copies, launched = session.copies, env.launched
        if copies is None:
            return NO_COPIES
        why = copies.memory_snapshots_unavailable(launched, env.obs_region_inode)
        if why is not None or launched is None:  # (it says why an env without a process cannot)
            return why or "the env has no process"
        # Nothing of the env runs now (the worker checked: one thread, blocked reading its next
        # request, no other process), so its workspace holds still while the worker copies it.
        room = self.store.room()
        copy = tempfile.mkdtemp(prefix="snap-", dir=os.path.dirname(env.workspace))
        try:
            nbytes = copy_workspace(env.workspace, copy, max_bytes=room)
            # the budget before the env is asked (a refusal after the swap would leave it changed):
            # the workspace copy and, for the holder, half the env's memory (shared with the source)
            needed = nbytes + pid_pss(env.pid or 0) // 2
            if needed > room:
                raise SnapshotBudgetExceeded(self.store.over_budget_message(needed))
            nonce = secrets.token_hex(8)
            sock = copies.begin_swap(launched, nonce)
        except SnapshotBudgetExceeded:
            shutil.rmtree(copy, ignore_errors=True)
            raise
        except Exception as exc:  # noqa: BLE001 - the env was not asked: nothing changed
            shutil.rmtree(copy, ignore_errors=True)
            return f"could not prepare it: {type(exc).__name__}: {exc}"
        return Swap(copies, env, sock, copy, nbytes, nonce)

    def end_swap(
        self, swap: Swap, session: Session, source: int, status: str, reply: bytes, payloads: list
    ) -> Result | None:
        """The env answered its swap request: the snapshot's result, or None when it did not swap
        (its answer is then an ordinary one)."""
        env = swap.env
        info = None
        if status == OK:
            try:
                answer = parse_json(reply)
                info = answer.get("snapshot") if isinstance(answer, dict) else None
            except ValueError:
                pass
        swapped = isinstance(info, dict) and info.get("kind") == MEMORY and not payloads
        launched = env.launched
        try:
            result = (
                swap.copies.end_swap(launched, swap.sock, swapped, swap.workspace_copy)
                if launched is not None
                else None
            )
        except Exception as exc:  # noqa: BLE001 - the env swapped but cannot be tracked: end it
            log.warning("memory snapshot of env %s: %s", source, exc)
            shutil.rmtree(swap.workspace_copy, ignore_errors=True)
            if launched is not None:
                launched.kill()
            return ERROR, json_error(f"memory snapshot of env {source} failed: {exc}; the env was ended"), []
        if result is None:
            shutil.rmtree(swap.workspace_copy, ignore_errors=True)
            return None
        env.launched, holder = result
        env.workspace_pinned = True  # (the holder keeps it mounted: the slot's next process gets another)
        nbytes = holder.pss() + swap.workspace_bytes
        try:
            held = self.store.hold(session.sid, source, MEMORY, b"", holder=holder, nbytes=nbytes)
        except SnapshotBudgetExceeded as exc:
            return ERROR, json_error(f"snapshot of env {source} refused: {exc}", refused="budget"), []
        return OK, json.dumps({"snapshot": held.describe()}).encode(), []

    # ================================================================== restoring one
    def replace_with_copies(self, session: Session, envs: list[EnvProcess], holder: Holder) -> dict[int, str]:
        """Replace each env's process with a copy forked from a memory snapshot's ``holder``, ready
        for its restore request. Returns ``{env.index: reason}`` for those that could not be: nothing
        changed if the holder is gone or an env is busy; a slot emptied for a copy that then failed
        (twice: a copy whose set-up failed is forked once more) gets a fresh env, as after a crash."""
        if holder.released or not holder.alive():
            why = "the snapshot's holder is gone (released, or its worker lost it)"
            return {env.index: why for env in envs}
        failed = {env.index: f"the env is {env.state.value}, not idle" for env in envs if not _replaceable(env)}
        envs = [env for env in envs if env.index not in failed]
        for env in envs:
            if env.state is QUEUED:  # a respawn waiting for a start slot: the copy takes its place
                env.state, env.pending_start = DEAD, None
        # The occupants are killed, not waited for: a SIGKILLed process runs no code of its own again,
        # its pid namespace dies with it, and the copy gets a cgroup and (below) a workspace of its own
        # content. The worker reaps its children later, as after any kill.
        for env in envs:
            self.spawner.kill_env(session, env)
        errors = self._fork_copies(session, envs, holder)
        if errors and not holder.released and holder.alive():
            # A copy's set-up is a handful of namespace and mount calls, gated by the worker; one
            # that failed (rarely, and not for the holder's sake: its other copies succeed) is
            # forked again before its slot is given up.
            for env in errors:
                log.warning(
                    "session %s env %d: a memory snapshot's copy failed (%s); forking it again",
                    session.sid,
                    env.global_index,
                    errors[env],
                )
            errors = self._fork_copies(session, list(errors), holder)
        for env, why in errors.items():
            failed[env.index] = why
            self.spawner.queue_start(session, env, None)
        return failed

    def _fork_copies(self, session: Session, envs: list[EnvProcess], holder: Holder) -> dict[EnvProcess, str]:
        """Fork a copy from ``holder`` into each (emptied) slot, as one batch; the copies are registered
        and idle. Returns why each slot that has none failed (its process killed, if it had one)."""
        launcher, started = session.copies, []
        errors: dict[EnvProcess, str] = {}
        if launcher is None:  # (a holder exists only where the session's launcher made it)
            return {env: f"could not fork a copy: {NO_COPIES}" for env in envs}
        spawner = self.spawner
        batch: list = []  # the copies started together (launcher._PendingCopy)
        for env in envs:
            try:
                spawner.fresh_workspace_if_pinned(env)
                spawner.wipe(env.workspace)
                copy_workspace(holder.workspace, env.workspace)
                env.spawn(
                    _CopyStarter(launcher, holder, batch), lambda e, i, o, r: spawner.launch_spec(session, e, i, o, r)
                )
            except Exception as exc:  # noqa: BLE001 - this slot stays empty
                errors[env] = f"could not fork a copy: {type(exc).__name__}: {exc}"
                continue
            started.append(env)
        if batch:
            launcher.finish_copies(holder, batch)
        for env in started:
            launched = env.launched
            if launched is not None and launched.setup_error is None:
                self.poller.watch_env(env)
                env.state = IDLE
                env.pending_start = None
                continue
            errors[env] = f"could not fork a copy: {launched.setup_error if launched else 'no process'}"
            spawner.kill_env(session, env)
        return errors


class _CopyStarter:
    """Backend-shaped, for ``EnvProcess.spawn``: its launch asks a memory snapshot's holder for a copy
    (:meth:`~.launcher.SnapshotLauncher.start_copy`); ``finish_copies`` completes the batch."""

    name = "namespaces"

    def __init__(self, launcher: SnapshotLauncher, holder: Holder, batch: list) -> None:
        self.launcher, self.holder, self.batch = launcher, holder, batch

    def launch(self, spec: LaunchSpec) -> Launched:
        return self.launcher.start_copy(self.holder, spec, self.batch)


def _replaceable(env: EnvProcess) -> bool:
    """Whether a memory snapshot's copy may take ``env``'s slot now: idle, dead, or (re)starting
    with nobody waiting for its first answer (a respawn after a crash)."""
    if env.state in (IDLE, DEAD, QUEUED, STARTING):
        return True
    call = env.current
    return env.state is BUSY and call is not None and call.kind == "start" and call.user_call is None
