"""The step batch a :class:`~boltzlabs_gym.vector.BoltzLabsVecEnv` owns: its buffers (the batch of
observations, rewards and flags, which envs are due an autoreset, each env's seed), how a batch of
actions or resets goes out, and how every reply is read back into the buffers.

Replies whose shape is known are read by the fast paths of :mod:`~boltzlabs_gym.vector.fast_paths`
(an array observation, a Dict/Tuple of arrays only, a sandbox of several envs' rows); every other
reply by the general path here (:meth:`StepBatch.take_step`, :meth:`StepBatch.take_reset`), which
decodes it against the env's space and says in its info what went wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from copy import deepcopy
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from ..client.pool import OK, RLPool
from ..client.results import EnvResult, ResetOutcome, Transition, parse_result, read_reset, read_step
from ..wire import codec, slot_layout
from ..wire.spaces import JsonSpace
from .env_spaces import EnvSpaces, zero_observation
from .fast_paths import ArraysSteps, PlainSteps, SandboxRows
from .gym_errors import ActionBatchError, VectorTimeoutError

__all__ = ["InfoBatch", "StepBatch"]


class InfoBatch(VectorEnv):
    """Gymnasium's info batching (``VectorEnv._add_info``) for a batch of ``num_envs`` envs."""

    def __init__(self, num_envs: int):
        self.num_envs = num_envs


class StepBatch:
    """A vector env's buffers, and the reading of every reply of a batch into them.

    ``spaces`` are the vector env's (:func:`~boltzlabs_gym.vector.env_spaces.env_spaces`);
    ``gym_host`` says whether the envs are Gymnasium envs (array observations come as payloads)
    rather than an env directory's ``serve()`` (JSON values). The arrays :meth:`collect_step` and
    :meth:`batched_obs` return are copies, or the buffers themselves with ``copy=False``.
    """

    def __init__(self, pool: RLPool, spaces: EnvSpaces, gym_host: bool):
        n = self.num_envs = pool.n
        self.pool = pool
        self.gym_host = gym_host
        space = self.single_observation_space = spaces.single_observation_space
        self.single_action_space, self.action_space = spaces.single_action_space, spaces.action_space
        obs_spaces = self.obs_spaces = spaces.obs_spaces
        # Gymnasium env hosts send array observations as one payload: the fast, equally strict decoder.
        self.obs_leaf = codec.ArrayLeaf.of(space) if gym_host else None
        # Each env's observations are decoded against its own space (they differ in bounds with
        # observation_mode="different"); one decoder for all when every env has the same space.
        self.obs_decoders = [
            self.decode_obs if s is obs_spaces[0] else functools.partial(self.decode_obs_of, s) for s in obs_spaces
        ]
        #: The seed each env was last reset with (None if it never was).
        self.env_seeds: list[int | None] = [None] * n
        self.discrete_action = gym_host and isinstance(self.single_action_space, gym.spaces.Discrete)
        #: The shape a batch of array actions has (Box, MultiBinary, MultiDiscrete), else None.
        action_leaf = codec.ArrayLeaf.of(self.single_action_space) if gym_host else None
        self.action_rows_shape = (n, *action_leaf.shape) if action_leaf is not None else None
        self.zero_obs = zero_observation(space)
        self.env_obs: list = [deepcopy(self.zero_obs) for _ in range(n)]
        #: The batch of observations: an array, or a dict/tuple of them (Dict/Tuple spaces).
        self.observations: Any = create_empty_array(space, n, np.zeros)
        array_obs = cast(np.ndarray, self.observations) if self.obs_leaf is not None else None
        self.rewards = np.zeros(n, dtype=np.float64)
        self.terminations = np.zeros(n, dtype=np.bool_)
        self.truncations = np.zeros(n, dtype=np.bool_)
        #: Which envs finished their episode (or failed) and are reset on their next step.
        self.autoreset_envs = np.zeros(n, dtype=np.bool_)
        flags = (self.rewards, self.terminations, self.truncations)
        leaf = self.obs_leaf
        self.plain_steps = PlainSteps(leaf, array_obs, *flags) if leaf is not None and array_obs is not None else None
        self.arrays_steps = ArraysSteps.of(space, self.observations, obs_spaces, gym_host, *flags)
        #: A Dict/Tuple of arrays only's batch arrays, whose rows are written as replies are read.
        self.batch_leaves = self.arrays_steps.leaves if self.arrays_steps is not None else None
        #: One observation's skeleton in a sandbox reply's rows (several envs per sandbox): an array
        #: space's, or a Dict/Tuple of arrays only's; None when the space has no rows.
        row_skeleton = leaf.skeleton if leaf is not None else slot_layout.array_skeleton(space) if gym_host else None
        self.sandbox_rows = SandboxRows(row_skeleton, array_obs, self.batch_leaves, *flags)
        #: Several envs per sandbox: Discrete step batches go out packed per sandbox (see
        #: :meth:`~boltzlabs_gym.client.batch_calls.BatchCalls.send_steps`).
        self.sandboxed = pool.envs_per_sandbox > 1
        self.pending_reset_ops: np.ndarray | None = None
        self.pending_reset_mask: np.ndarray | None = None
        self.add_info = InfoBatch(n)._add_info

    # ------------------------------------------------------------------ decoding
    def decode_obs(self, obj: Any, payloads: list) -> Any:
        if self.obs_leaf is not None:
            return self.obs_leaf.decode(obj, payloads)  # validated like codec.decode, faster
        return codec.decode(self.obs_spaces[0], obj, payloads, copy=True, lenient=not self.gym_host)

    def decode_obs_of(self, space: gym.Space, obj: Any, payloads: list) -> Any:
        """An observation of an env whose space differs from env 0's (``observation_mode="different"``)."""
        return codec.decode(space, obj, payloads, copy=True, lenient=not self.gym_host)

    def decode_info(self, obj: Any, payloads: list) -> dict:
        if obj is None or (type(obj) is dict and not obj):
            return {}
        info = codec.decode_info(obj, payloads, copy=True)
        return info if isinstance(info, dict) else {"info": info}

    def encode_action(self, i: int, action: Any) -> tuple[Any, list]:
        if self.discrete_action and isinstance(action, (int, np.integer)) and not isinstance(action, bool):
            return int(action), []  # the env casts it to its space's dtype, as on the int fast path
        if self.gym_host:
            return codec.encode_action(self.single_action_space, action)
        return codec.to_json_safe(action), []

    def encode_env_action(self, i: int, action: Any) -> tuple[Any, list]:
        """:meth:`encode_action`, refused with a ``ValueError`` naming env ``i`` and the space."""
        try:
            return self.encode_action(i, action)
        except (codec.CodecError, TypeError, ValueError) as exc:
            raise ValueError(
                f"action for env {i} does not fit the action space {self.single_action_space}: {exc}"
            ) from None

    @staticmethod
    def step_item(i: int, obj: Any, payloads: Sequence[bytes], mode: AutoresetMode) -> tuple:
        """Env ``i``'s step request for an encoded action (``autoreset`` in SAME_STEP mode)."""
        op = {"op": "step", "action": obj}
        if mode == AutoresetMode.SAME_STEP:
            op["autoreset"] = True
        return (i, op, payloads)

    def read_reset(self, r: EnvResult, reset_timeout: float) -> ResetOutcome:
        """A reset result read by :mod:`~boltzlabs_gym.client.results`; a failed env's obs is the zero obs.

        ``reset_timeout`` is the pool's, read once per batch by the caller."""
        out = read_reset(r, reset_timeout, self.obs_decoders[r.index], self.decode_info)
        return out if out.obs is not None else out._replace(obs=deepcopy(self.zero_obs))

    def read_step(self, r: EnvResult, step_timeout: float) -> Transition:
        """A step result read by :mod:`~boltzlabs_gym.client.results`, with zero obs where none could be had.

        ``step_timeout`` is the pool's, read once per batch by the caller."""
        t = read_step(r, step_timeout, self.obs_decoders[r.index], self.decode_info)
        if t.obs is None:
            t = t._replace(obs=deepcopy(self.zero_obs))
        if t.reset_info is not None and t.reset_obs is None:
            t = t._replace(reset_obs=deepcopy(self.zero_obs))
        return t

    # ------------------------------------------------------------------ observations
    def set_obs(self, i: int, obs: Any) -> None:
        """Env ``i``'s observation: a row of the batch itself for an array space, or of each of
        its arrays for a Dict/Tuple of arrays (written as it is read, as whole sandboxes' blocks
        are), else kept for :func:`concatenate`."""
        if self.obs_leaf is not None:
            self.observations[i] = obs
        elif self.batch_leaves is not None:
            values: list = []
            slot_layout.array_leaves(self.single_observation_space, obs, values)  # decoded: the space's structure
            for batch, value in zip(self.batch_leaves, values):
                batch[i] = value
        else:
            self.env_obs[i] = obs

    def batched_obs(self, copy: bool):
        if self.obs_leaf is not None:
            out = self.observations  # every row was written in place (set_obs)
            return out.copy() if copy else out
        if self.batch_leaves is not None:
            return deepcopy(self.observations) if copy else self.observations
        self.observations = concatenate(self.single_observation_space, self.env_obs, self.observations)
        return deepcopy(self.observations) if copy else self.observations

    def wait(self, timeout: float | None, raw: bool):
        """The pool's results, a sandbox of several envs as one block (see
        :meth:`~boltzlabs_gym.client.batch_calls.BatchCalls.wait_sandboxes`); running out of time raises
        what AsyncVectorEnv raises, too."""
        try:
            return self.pool.batch_calls.wait_sandboxes(timeout, raw)
        except TimeoutError as exc:
            raise VectorTimeoutError(str(exc), getattr(exc, "worker", None)) from exc

    # ------------------------------------------------------------------ resets
    def send_resets(self, seeds: list, mask: np.ndarray | None, options: dict | None) -> None:
        """Send the reset of every env, or of those in ``mask``, env ``i`` with ``seeds[i]`` and
        ``options``; :meth:`collect_resets` collects them."""
        indices = range(self.num_envs) if mask is None else np.flatnonzero(mask)
        op_options = codec.to_json_safe(options) if options else None
        items = []
        for i in indices:
            op = {"op": "reset", "seed": seeds[i]}
            if op_options:
                op["options"] = op_options
            items.append((int(i), op, ()))
        self.pool.batch_async(items)
        self.pending_reset_mask = mask
        for i in indices:
            if seeds[i] is not None:
                self.env_seeds[i] = seeds[i]

    def collect_resets(self, timeout: float | None, mode: AutoresetMode, copy: bool):
        """``(obs, infos)`` of the resets :meth:`send_resets` sent."""
        mask, self.pending_reset_mask = self.pending_reset_mask, None
        sandboxes, results = self.wait(timeout, raw=False)
        reset_timeout = self.pool.reset_timeout
        if mask is None:
            self.terminations[:] = False
            self.truncations[:] = False
            self.autoreset_envs[:] = False
        else:
            self.terminations[mask] = False
            self.truncations[mask] = False
            self.autoreset_envs[mask] = False
        take_reset = functools.partial(self.take_reset, mode=mode)
        infos: dict = {}
        for sandbox in sandboxes:
            infos = self.sandbox_rows.take_reset(sandbox, infos, reset_timeout, take_reset)
        for r in results:
            infos = self.take_reset(r, infos, reset_timeout, mode)
        return self.batched_obs(copy), infos

    def take_reset(self, r: EnvResult, infos: dict, reset_timeout: float, mode: AutoresetMode) -> dict:
        """Store one env's reset result; the infos with its info added."""
        obs, env_info, failure = self.read_reset(r, reset_timeout)
        self.set_obs(r.index, obs)
        if failure is not None:
            self.autoreset_envs[r.index] = mode != AutoresetMode.DISABLED
        return self.add_info(infos, env_info, r.index)

    # ------------------------------------------------------------------ steps
    def send_step(self, actions: Any, mode: AutoresetMode) -> None:
        """Send every env's step (or its autoreset); :meth:`collect_step` collects it."""
        ints = self.discrete_actions(actions)
        if self.sandboxed and not (mode == AutoresetMode.DISABLED and self.autoreset_envs.any()):
            # Several envs per sandbox: a batch of Discrete actions, or of array actions (each
            # sandbox's rows as one payload), is packed per sandbox with no per-env work here.
            reset_ops = (
                self.autoreset_envs.copy() if mode != AutoresetMode.DISABLED else np.zeros_like(self.autoreset_envs)
            )
            same_step = mode == AutoresetMode.SAME_STEP
            if ints is not None:
                self.pool.batch_calls.send_steps(ints, reset_ops, autoreset=same_step)
                self.pending_reset_ops = reset_ops
                return
            rows = self.action_rows(actions)
            if rows is not None and self.pool.batch_calls.send_action_rows(rows, reset_ops, autoreset=same_step):
                self.pending_reset_ops = reset_ops
                return
        if ints is None and not self.sandboxed:
            rows = self.action_rows(actions)
            if rows is not None and (mode != AutoresetMode.DISABLED or not self.autoreset_envs.any()):
                self.pool.batch_async(self.row_items(rows, mode))
                self.pending_reset_ops = self.autoreset_envs.copy()
                return
        per_env = ints if ints is not None else self.split_actions(actions)
        items: list[tuple[int, dict[str, Any], Sequence[Any]]] = []
        reset_ops = np.zeros(self.num_envs, dtype=np.bool_)
        payloads: Sequence[Any]
        for i, action in enumerate(per_env):
            if self.autoreset_envs[i] and mode != AutoresetMode.DISABLED:
                items.append((i, {"op": "reset", "seed": None}, ()))
                reset_ops[i] = True
                continue
            if self.autoreset_envs[i] and mode == AutoresetMode.DISABLED:
                raise ValueError(
                    f"env {i} finished its episode and autoreset is DISABLED: reset it first with "
                    "reset(options={'reset_mask': mask})"
                )
            obj, payloads = (action, ()) if ints is not None else self.encode_env_action(i, action)
            items.append(self.step_item(i, obj, payloads, mode))
        self.pool.batch_async(items)
        self.pending_reset_ops = reset_ops

    def row_items(self, rows: np.ndarray, mode: AutoresetMode) -> list:
        """Per-env items of a batch of array actions (:meth:`action_rows`): env ``i`` steps with its
        row, in the batch's dtype (what :func:`~boltzlabs_gym.wire.codec.encode_action` makes of the
        row: what SyncVectorEnv hands the env), or resets where it is due an autoreset. Every step
        item shares one op, whose line is encoded once per kind
        (:func:`~boltzlabs_gym.wire.protocol.array_step_line`)."""
        row_bytes = rows[0].nbytes if len(rows) else 0
        op: dict[str, Any] = {"op": "step", "action": {codec.ND: [0, rows.dtype.str, list(rows.shape[1:])]}}
        if mode == AutoresetMode.SAME_STEP:
            op["autoreset"] = True
        data = rows.tobytes()  # a copy: the caller may change its array once step_async returns
        due = self.autoreset_envs
        items: list = []
        for i in range(self.num_envs):
            if due[i]:
                items.append((i, {"op": "reset", "seed": None}, ()))
            else:
                items.append((i, op, [data[i * row_bytes : (i + 1) * row_bytes]]))
        return items

    def discrete_actions(self, actions: Any) -> list | None:
        """A Discrete env's batch of actions as plain ints, when it is an integer array of
        shape ``(num_envs,)`` (what policies hand over); else ``None`` (the per-env codec
        path, which says what is wrong). Ranges are checked where the codec checks them:
        in the env, which reports an out-of-range action in that env's slot."""
        if (
            not self.discrete_action
            or type(actions) is not np.ndarray
            or actions.dtype.kind not in "iu"
            or actions.shape != (self.num_envs,)
        ):
            return None
        return actions.tolist()

    def action_rows(self, actions: Any) -> np.ndarray | None:
        """A batch of array actions as one C-contiguous array of shape ``(num_envs, ...)`` in its own
        numeric dtype (what each env then gets a row of, as from SyncVectorEnv), when it is one;
        else ``None`` (the per-env codec path, which says what is wrong)."""
        if (
            self.action_rows_shape is None
            or type(actions) is not np.ndarray
            or actions.shape != self.action_rows_shape
            or actions.dtype.kind not in "biuf"
        ):
            return None
        return np.ascontiguousarray(actions)

    def split_actions(self, actions: Any) -> list:
        if isinstance(self.single_action_space, JsonSpace):
            if isinstance(actions, (str, bytes, dict)) or not hasattr(actions, "__len__"):
                raise ActionBatchError(
                    f"actions must be a sequence of {self.num_envs} actions, got {type(actions).__name__}"
                )
            per_env = list(actions)
        else:
            try:
                per_env = list(iterate(self.action_space, actions))
            except Exception as exc:  # noqa: BLE001 - say which shape was expected
                raise ActionBatchError(
                    f"actions do not fit the batched action space {self.action_space}: {exc}"
                ) from None
        if len(per_env) != self.num_envs:
            raise ActionBatchError(f"expected {self.num_envs} actions (one per env), got {len(per_env)}")
        return per_env

    def collect_step(self, timeout: float | None, mode: AutoresetMode, copy: bool):
        """``(obs, rewards, terminations, truncations, infos)`` of the step batch :meth:`send_step` sent."""
        # send_step sets it.
        reset_ops, self.pending_reset_ops = cast(np.ndarray, self.pending_reset_ops), None
        pool = self.pool
        limits = (pool.step_timeout, pool.reset_timeout)
        infos: dict = {}
        same_step = mode == AutoresetMode.SAME_STEP
        failed = np.zeros(self.num_envs, dtype=np.bool_)
        plain, arrays, sandbox_rows, take_step = self.plain_steps, self.arrays_steps, self.sandbox_rows, self.take_step
        # Observations in shared regions are read in place: the one copy of each is the one
        # into this batch (every result is taken in this block, and none is kept past it).
        steady = not reset_ops.any()  # the usual step batch: no env resets in it
        with pool.batch_calls.lending_obs_views():
            sandboxes, results = self.wait(timeout, raw=True)
            for sandbox in sandboxes:
                if steady and sandbox_rows.take_steady(sandbox, same_step):
                    continue
                infos = sandbox_rows.take_step(sandbox, reset_ops, same_step, failed, infos, limits, take_step)
            if results:
                infos = sandbox_rows.add_pending_info(infos, self.num_envs)
            for r in results:
                i = r.index
                if plain is not None and r.status == OK and not reset_ops[i] and plain.take(r, same_step):
                    continue
                if arrays is not None and not reset_ops[i] and arrays.take(r, same_step):
                    continue
                infos = take_step(r, bool(reset_ops[i]), same_step, failed, infos, limits)
            infos = sandbox_rows.add_pending_info(infos, self.num_envs)
            if plain is not None and plain.pending_infos:
                infos = plain.add_pending_infos(infos, self.num_envs)
            del sandboxes, results
        done = np.logical_or(self.terminations, self.truncations)
        if same_step:
            # Only envs that could not reset in-process (their step failed) still need one.
            self.autoreset_envs = np.logical_and(done, failed)
        else:
            self.autoreset_envs = done
        return (
            self.batched_obs(copy),
            np.copy(self.rewards),
            np.copy(self.terminations),
            np.copy(self.truncations),
            infos,
        )

    def take_step(
        self, r: EnvResult, reset_op: bool, same_step: bool, failed: np.ndarray, infos: dict, limits: tuple
    ) -> dict:
        """Store one env's result of a step batch (a step, or the reset that autoreset sent in its
        place); the infos with its info added."""
        parse_result(r)
        i = r.index
        if reset_op:
            obs, env_info, failure = self.read_reset(r, limits[1])
            self.set_obs(i, obs)
            self.rewards[i] = 0.0
            self.terminations[i] = False
            self.truncations[i] = failed[i] = failure is not None
            return self.add_info(infos, env_info, i)
        obs, reward, term, trunc, env_info, failure, reset_obs, reset_info = self.read_step(r, limits[0])
        self.rewards[i], self.terminations[i], self.truncations[i] = reward, term, trunc
        failed[i] = failure is not None
        if same_step and (term or trunc):
            infos = self.add_info(infos, {"final_obs": obs, "final_info": env_info}, i)
            if reset_info is not None:
                obs, env_info = reset_obs, reset_info
            else:
                # The step failed, so the env did not reset itself; its reset happens next step.
                env_info = {k: v for k, v in env_info.items() if k.startswith("boltzlabs_")}
        self.set_obs(i, obs)
        return self.add_info(infos, env_info, i)

    # ------------------------------------------------------------------ snapshots
    def snapshot_meta(self, index: Any, what: str) -> dict:
        """What a snapshot of env ``index`` keeps of the batch's state: whether the env is due an
        autoreset, and its seed."""
        i = self.pool.snapshot_keeper.check_index(index, what)
        return {"autoreset": bool(self.autoreset_envs[i]), "seed": self.env_seeds[i]}

    def take_restored(
        self, results: list[EnvResult], meta: dict, reseed: Sequence[int] | None, mode: AutoresetMode, copy: bool
    ):
        """``(obs, infos)`` after a restore or fork: each restored env's result stored as a reset's,
        its episode going on where the snapshot's (``meta``) was."""
        reset_timeout = self.pool.reset_timeout
        due = bool(meta.get("autoreset")) and mode != AutoresetMode.DISABLED
        seed = meta.get("seed")
        infos: dict = {}
        for pos, r in enumerate(results):
            i = r.index
            self.terminations[i] = self.truncations[i] = False
            self.rewards[i] = 0.0
            self.autoreset_envs[i] = due
            self.env_seeds[i] = int(reseed[pos]) if reseed is not None else (seed if isinstance(seed, int) else None)
            infos = self.take_reset(r, infos, reset_timeout, mode)  # a failed restore is due a reset
        return self.batched_obs(copy), infos
