"""Several envs per sandbox, behind the route: a pool with ``envs_per_sandbox`` > 1 sends its
per-env items through a :class:`SandboxRoute`, which packs them into one item per sandbox
(:func:`~boltzlabs_gym.client.sandbox_replies.pack`) for the route below it (a worker, several, or the
direct lane: they see sandboxes), and reads the sandbox replies back as per-env results in the
items' order. A caller that reads observations by the block (the vector env) takes the replies
as one :class:`~boltzlabs_gym.client.sandbox_replies.SandboxResult` per sandbox instead
(:meth:`SandboxRoute.wait_sandboxes`).

A sandbox that fails restarts all its envs: those that were not in the request are remembered
here, and their next step is answered, as a failure, without a request (see
:meth:`SandboxRoute.send`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..wire.protocol import ERROR
from .results import EnvResult, parse_result
from .routes import Items, Route
from .sandbox_replies import SandboxLayout, SandboxPlan, SandboxResult, pack, pack_action_rows, pack_steps

__all__ = ["SandboxRoute", "step_items"]


def step_items(actions: Sequence, resets: np.ndarray, autoreset: bool) -> list:
    """Per-env items of a Discrete step batch: env ``i`` steps with ``actions[i]``, or resets (seed
    ``None``) where ``resets[i]``; ``autoreset`` marks every step for a reset in its own reply."""
    step: dict = {"op": "step", "autoreset": True} if autoreset else {"op": "step"}
    reset = {"op": "reset", "seed": None}
    return [(i, reset if resets[i] else dict(step, action=a), ()) for i, a in enumerate(actions)]


class SandboxRoute:
    """A route of per-env items over ``inner``, a route of one item per sandbox of ``layout``.

    ``mixed_deadline``: what a step batch with resets in it is held to (both deadlines, see
    :data:`~boltzlabs_gym.wire.protocol.SANDBOX_DEADLINE`).
    """

    def __init__(self, inner: Route, layout: SandboxLayout, mixed_deadline: float):
        self.inner = inner
        self.layout = layout
        self._mixed_deadline = mixed_deadline
        #: The plan of the batch in flight, one per sandbox it names.
        self._plans: list[SandboxPlan] | None = None
        #: Envs whose sandbox was restarted while they were not in a request, with the reason.
        self._restarted: dict[int, str] = {}
        self._answered: list[tuple[int, EnvResult]] = []  # items answered without a request
        self._sent_positions: list[int] | None = None  # the batch positions of the items sent, if not all
        self._batch_size = 0

    def send(self, items: Items) -> float:
        """Send per-env ``items`` as one sandbox request per sandbox; envs whose sandbox was restarted
        under them are answered here, on their next step."""
        answered: list[tuple[int, EnvResult]] = []
        told: list[int] = []
        self._sent_positions = None
        if self._restarted:
            items, answered, told = self._answer_restarted(items)
        sandboxed, plans = pack(self.layout, items, self._mixed_deadline)
        sent_at = self.inner.send(sandboxed) if sandboxed else time.perf_counter()
        for index in told:  # only once the batch went out: a refused one leaves the marks as they were
            self._restarted.pop(index, None)
        self._plans = plans
        self._answered = answered
        self._batch_size = len(items) + len(answered)  # every item: sent, or answered here
        return sent_at

    def send_steps(self, actions: list[int], resets: np.ndarray, autoreset: bool) -> float:
        """A Discrete step batch (see :func:`step_items`), packed per sandbox without per-env work
        (:func:`~boltzlabs_gym.client.sandbox_replies.pack_steps`) unless envs wait to be told of a restart."""
        if self._restarted:
            return self.send(step_items(actions, resets, autoreset))
        return self._send_whole(pack_steps, actions, resets, autoreset)

    def send_action_rows(self, actions: np.ndarray, resets: np.ndarray, autoreset: bool) -> float | None:
        """A step batch of array actions, each sandbox's rows as one payload
        (:func:`~boltzlabs_gym.client.sandbox_replies.pack_action_rows`); ``None``, sending nothing,
        while envs wait to be told of a restart (the caller sends per-env items then)."""
        if self._restarted:
            return None
        return self._send_whole(pack_action_rows, actions, resets, autoreset)

    def _send_whole(self, pack_whole: Callable, actions: Any, resets: np.ndarray, autoreset: bool) -> float:
        """Send a step batch of every env, packed per whole sandbox by ``pack_whole``
        (:func:`~boltzlabs_gym.client.sandbox_replies.pack_steps` or ``pack_action_rows``)."""
        layout = self.layout
        if len(actions) != layout.n:
            raise ValueError(f"expected exactly {layout.n} actions (one per env), got {len(actions)}")
        sandboxed, plans = pack_whole(layout, actions, resets, autoreset, self._mixed_deadline)
        sent_at = self.inner.send(sandboxed)
        self._plans, self._answered, self._sent_positions, self._batch_size = plans, [], None, layout.n
        return sent_at

    def _answer_restarted(self, items: Items) -> tuple[list, list, list]:
        """Steps of envs whose sandbox was restarted while they were idle (a neighbour failed) are
        not sent: the env lost its episode, and says so here, as a failed step. A reset (soft or
        hard) starts the env's next episode: it is sent, and settles the matter; any other op
        (``call``, ``get_attr``...) is sent and leaves it pending. Returns the items to send, the
        answered ones, and the envs whose mark goes once the batch is sent."""
        sent, answered, told = [], [], []
        restarted = self._restarted
        for pos, item in enumerate(items):
            index, op = item[0], item[1]
            name = op.get("op") if type(op) is dict else None
            reason = restarted.get(index) if isinstance(index, (int, np.integer)) else None
            if reason is not None and name == "step":
                answered.append((pos, EnvResult(int(index), ERROR, {"message": reason}, [])))
                told.append(int(index))
                continue
            if reason is not None and name in ("reset", "hard_reset"):
                told.append(int(index))
            sent.append((pos, item))
        self._sent_positions = [pos for pos, _ in sent]
        return [item for _, item in sent], answered, told

    def wait_sandboxes(self, timeout: float) -> tuple[list[SandboxResult], list[EnvResult], dict[str, float]]:
        """The batch's sandboxes' replies, one :class:`SandboxResult` each; the per-env results
        answered without a request; and worker_ms per worker address. A failed sandbox's envs
        that were not in its request are remembered (see :meth:`send`)."""
        plans, self._plans = self._plans or [], None
        replies, per_worker_ms = self.inner.wait(timeout, True) if plans else ([], {})
        layout = self.layout
        sandboxes = [SandboxResult(plan, r, layout.envs(plan.sandbox)) for plan, r in zip(plans, replies)]
        for sandbox in sandboxes:
            sandbox.failures()  # reads a failed sandbox's reply: which of its envs it restarted
            self._note_restarted(sandbox)
        return sandboxes, [r for _pos, r in self._answered], per_worker_ms

    def wait(self, timeout: float, raw: bool) -> tuple[list[EnvResult], dict[str, float]]:
        """The batch's per-env results in item order (reply lines unparsed if ``raw``), and worker_ms per worker."""
        sandboxes, _, per_worker_ms = self.wait_sandboxes(timeout)
        results: list = [None] * self._batch_size
        positions = self._sent_positions
        for sandbox in sandboxes:
            for pos, r in zip(sandbox.plan.positions, sandbox.expand()):
                results[positions[pos] if positions else pos] = r
        for pos, r in self._answered:
            results[pos] = r
        if not raw:
            results = [parse_result(r) for r in results]
        return results, per_worker_ms

    def _note_restarted(self, sandbox: SandboxResult) -> None:
        if sandbox.restarted:
            self._restarted.update(sandbox.restarted)
