"""The Gymnasium env host: one ``gymnasium.Env`` answering the env line protocol inside its sandbox.

This is the env line protocol that :func:`boltzlabs_gym.env.serve` speaks
(:mod:`~boltzlabs_gym.envside.json_host`: one JSON request line in, one JSON reply line out,
raw binary payloads announced by ``"_bin"``) for a real
Gymnasium env: spaces are described as JSON (:mod:`boltzlabs_gym.wire.spaces`) and
values cross as skeletons plus raw payloads (:mod:`boltzlabs_gym.wire.codec`), so
arrays never go through JSON lists.

Requests and replies (``enc(x)`` is :func:`boltzlabs_gym.wire.codec.encode` against the
env's space; ``info(x)`` is :func:`boltzlabs_gym.wire.codec.encode_info`; both may
reference the reply's payloads)::

    {"op": "describe"}
        -> {"server": "gym", "observation_space": <space json>, "action_space": <space json>,
            "metadata": <json>, "render_mode": str|null, "spec_id": str|null,
            "max_episode_steps": int|null,
            "observation_space_rng": <rng json>, "action_space_rng": <rng json>}
           (the spaces' random generators: boltzlabs_gym.wire.spaces.rng_state_to_json)
    {"op": "reset", "seed": int|null, "options": {...}|null}
        -> {"obs": enc(obs), "info": info(info)}
    {"op": "step", "action": enc(action), "autoreset": bool}
        -> {"obs": enc(obs), "reward": float, "terminated": bool, "truncated": bool,
            "info": info(info)}
           and, when "autoreset" is true and the step ended the episode, the env is
           reset (seed null) in the same request and the reply also carries
           "reset_obs": enc(obs), "reset_info": info(info)
           ("obs"/"info" stay the final step's, as in boltzlabs_gym.env.serve).
    {"op": "call", "name": str, "args": [...], "kwargs": {...}}
        -> {"value": info(result)}  (calls the attribute if callable, else returns it,
           like Gymnasium's VectorEnv.call; args/kwargs may hold __nd__ arrays)
    {"op": "get_attr", "name": str}           -> {"value": info(attribute)}  (never called)
    {"op": "set_attr", "name": str, "value": info(value)}  -> {}
    {"op": "render"}                          -> {"frame": info(env.render())}
                                                 (an rgb_array frame is a uint8 __nd__ array)
    {"op": "close"}                           -> {} and the process exits

Observations/actions of a space with no JSON form (a custom space) are described as
``{"type": "Json"}`` and sent as plain JSON (arrays as lists).

Failures: an exception in ``reset``/``step`` (or in decoding the action, or
encoding the result) does not end the process: the reply is a terminal transition
(``obs`` null, reward 0, ``terminated`` true) with ``info["boltzlabs_exception"] =
{"where": "reset"|"step"|"action"|"encode", "traceback": ...}``. An exception in
``call``/``get_attr``/``set_attr``/``render`` answers ``{"error": traceback}``.
A request line that is not a JSON object is answered with ``{"error": ...}`` and
the process serves on; a torn stream (bad ``_bin``, truncated payload,
over-long line) is answered and the process exits (the worker respawns it). A factory
(or the host's set-up) that raises is answered once, ``{"start_error": {"types": [...],
"message": ...}}`` (:mod:`boltzlabs_gym.wire.start_failure`), and the process exits.

Sandboxes of several envs: with ``BOLTZLABS_ENVS_PER_SANDBOX`` above 1 the process hosts
``BOLTZLABS_ENV_COUNT`` envs, one :class:`GymHost` per slot, and answers sandbox requests
with sandbox replies ("Sandboxes of several envs" in :mod:`boltzlabs_gym.wire.protocol`): a plain
step or reset of an env whose observations are one array, or a Dict/Tuple of arrays only, is a
row of the reply's arrays (:class:`~boltzlabs_gym.envside.sandbox_rows.SandboxRows`), every other
position carries the one-env reply above.

This module is the host, :class:`GymHost` (a request in, ``(reply, payloads)`` out); the loops that
read requests and write its replies are :mod:`~boltzlabs_gym.envside.gym_loops`, and the start-up
(building envs from factories, ``python -m``) is :mod:`~boltzlabs_gym.envside.gym_start`.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from math import isfinite
from typing import Any, cast

import numpy as np
from gymnasium import spaces as gs

from ..wire.codec import SHM, ArrayLeaf, decode, decode_info, encode, encode_info, to_json_safe
from ..wire.slot_layout import LeafPaths, array_skeleton, payload_layout, slot_spans
from ..wire.spaces import JsonSpace, rng_state_to_json, space_to_json
from . import obs_region, process_setup
from .failures import MAX_TRACEBACK_CHARS, error_transition
from .framing import payload_nbytes
from .info_columns import InfoColumns
from .sandbox_rows import SandboxRows
from .state import SnapshotRefused, restore_request, snapshot_reply

__all__ = ["GymHost", "region_reply", "MAX_PREMADE_ACTIONS"]

#: Discrete spaces up to this size get their actions made once (GymHost._actions).
MAX_PREMADE_ACTIONS = 1024


def _space_or_json(space: gs.Space) -> tuple[gs.Space, dict]:
    """The space used on the wire and its JSON: itself, or JsonSpace when it has no JSON form."""
    try:
        return space, space_to_json(space)
    except ValueError:
        return JsonSpace(), {"type": "Json"}


def _traceback() -> str:
    tb = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]
    sys.stderr.write(tb)
    sys.stderr.flush()
    return tb


class GymHost:
    """The request handlers for one env; :meth:`handle` maps a request to ``(reply, payloads)``."""

    def __init__(self, env: Any):
        self.env = env
        self.obs_space, self.obs_space_json = _space_or_json(env.observation_space)
        self.action_space, self.action_space_json = _space_or_json(env.action_space)
        # Hot path of the common case (array observations, Discrete or array actions, empty
        # infos): a step costs a few microseconds of serving around the env's own step.
        self._obs_leaf = ArrayLeaf.of(self.obs_space)
        #: Where each payload of a Dict/Tuple observation goes in a shared slot: ``(start, size)``
        #: (:func:`~boltzlabs_gym.wire.slot_layout.payload_layout`); ``None`` for any other space.
        layout = payload_layout(self.obs_space) if self._obs_leaf is None else None
        spans = slot_spans(layout) if layout is not None else None
        self._obs_layout = layout if spans is not None else None  # (None too: a dtype no slot holds)
        self._obs_spans: tuple[tuple[int, int], ...] = spans or ()
        self._layout_bytes = sum(size for _, size in self._obs_spans)
        #: A Dict/Tuple of arrays only: the skeleton all its observations encode to, and the step
        #: line of its whole slot as one array of bytes (a plain step then goes as one fixed line,
        #: with no encoder, as one array's does; the pool puts the skeleton back).
        self._obs_skeleton = array_skeleton(self.obs_space) if self._obs_layout is not None else None
        self._slot_leaf: ArrayLeaf | None = None
        self._leaf_paths: LeafPaths | None = None
        if self._obs_skeleton is not None:
            self._slot_leaf = ArrayLeaf(gs.Box(0, 255, (self._layout_bytes,), np.uint8))
            self._leaf_paths = LeafPaths(self.obs_space)
        #: Those arrays' places in this env's slot, once it has one.
        self._slot_arrays: list[np.ndarray] | None = None
        self._action_leaf = ArrayLeaf.of(self.action_space)
        #: A step's info of numbers as one row of typed columns, and its line's end (by column version).
        self._info_columns: InfoColumns | None = None
        #: the info columns' version, and a step line's end for them: with the observation as
        #: bytes, and in the shared region
        self._info_suffix: tuple[int, tuple[bytes, bytes]] = (-1, (b"", b""))
        self._discrete = None
        #: A Discrete space's actions as the numpy scalars the env is given, by ``action - start``
        #: (made once: a scalar per step cost a constructor call on the hot path of a sandbox request).
        self._actions: tuple = ()
        #: The observation the env last returned (a snapshot keeps it: a restore answers with it).
        self.last_obs: Any = None
        #: Whether a reset or restore started an episode in this process (a process the worker
        #: just (re)started has none: its predecessor's state died with it).
        self.started = False
        #: This env's slot in the process's shared observation region (an array of the space's
        #: dtype and shape on it), once a local pool asked for one (:meth:`obs_region`).
        self.shm_slot: np.ndarray | None = None
        #: The same for a Dict/Tuple observation: the slot's bytes, its payloads back to back.
        self.shm_payloads: memoryview | None = None
        if isinstance(self.action_space, gs.Discrete):
            start = int(self.action_space.start)
            self._discrete = (start, start + int(self.action_space.n), self.action_space.dtype.type)
            if int(self.action_space.n) <= MAX_PREMADE_ACTIONS:
                self._actions = tuple(self._discrete[2](start + a) for a in range(int(self.action_space.n)))

    # -- ops -------------------------------------------------------------------------

    def describe(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """Spaces (JSON), metadata, render mode, spec id and time limit of the env."""
        env = self.env
        spec = getattr(env, "spec", None)
        return {
            "server": "gym",
            "observation_space": self.obs_space_json,
            "action_space": self.action_space_json,
            "metadata": to_json_safe(dict(getattr(env, "metadata", None) or {})),
            "render_mode": to_json_safe(getattr(env, "render_mode", None)),
            "spec_id": getattr(spec, "id", None),
            "max_episode_steps": getattr(spec, "max_episode_steps", None),
            "observation_space_rng": rng_state_to_json(env.observation_space),
            "action_space_rng": rng_state_to_json(env.action_space),
        }, []

    def _env_reset(self, seed: Any, options: Any) -> tuple[Any, Any]:
        """``env.reset(seed=, options=)`` after checking both arguments; raises what either raises."""
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"reset seed must be an int or null, got {type(seed).__name__}")
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"reset options must be an object or null, got {type(options).__name__}")
        obs, info = self.env.reset(seed=seed, options=options)
        self.last_obs, self.started = obs, True
        return obs, info

    def _encode_reset(self, obs: Any, info: Any, out: list, zero_copy: bool = True) -> tuple[Any, Any]:
        """Encode a reset's (obs, info), appending payloads to ``out``; an encoding error's transition instead."""
        start = len(out)
        try:
            obs_j, _ = encode(self.obs_space, obs, out, zero_copy=zero_copy)
            info_j, _ = encode_info(info, out, zero_copy=zero_copy)
        except Exception:
            del out[start:]
            return None, error_transition("encode")["info"]
        return obs_j, info_j

    def _reset(self, seed: Any, options: Any, out: list, zero_copy: bool = True) -> tuple[Any, Any]:
        """Reset and encode, appending payloads to ``out``; (obs, info) or an error transition's."""
        try:
            obs, info = self._env_reset(seed, options)
        except Exception:
            return None, error_transition("reset")["info"]
        return self._encode_reset(obs, info, out, zero_copy)

    def reset(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """``env.reset(seed=, options=)``; an exception gives ``obs`` null and ``boltzlabs_exception``."""
        out: list = []
        slot = self.shm_slot
        if slot is not None:
            try:
                obs, info = self._env_reset(msg.get("seed"), msg.get("options"))
            except Exception:
                return {"obs": None, "info": error_transition("reset")["info"]}, []
            if type(obs) is np.ndarray and obs.dtype == slot.dtype and obs.shape == slot.shape:
                try:
                    info_j, _ = encode_info(info, out)
                except Exception:
                    del out[:]  # the encoders below say what is wrong
                else:
                    slot[...] = obs
                    return {"obs": self._obs_leaf.shm_skeleton, "info": info_j}, out  # type: ignore[union-attr]
            obs_j, info_j = self._encode_reset(obs, info, out)
            return {"obs": obs_j, "info": info_j}, out
        obs, info = self._reset(msg.get("seed"), msg.get("options"), out)
        reply = {"obs": obs, "info": info}
        if obs is not None and self.shm_payloads is not None:
            self._obs_payloads_to_slot(reply, out)
        return reply, out

    def obs_region(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """Make this process's shared observation region (one slot: this env) and describe it
        (:func:`region_reply`); with ``"use": true`` (sent by the worker once it has sealed it),
        write plain observations into it from now on. An env whose observation space is neither
        one array nor a Dict/Tuple of fixed-size arrays (:func:`~boltzlabs_gym.wire.slot_layout.payload_layout`)
        answers an error."""
        leaf, layout = self._obs_leaf, self._obs_layout
        if leaf is None and layout is None:
            return {
                "error": "no shared observation region: the observation space is neither one array "
                "nor a Dict/Tuple of fixed-size arrays"
            }, []
        nbytes = leaf.nbytes if leaf is not None else self._layout_bytes
        if msg.get("use") is not True:
            made = obs_region.create(1, nbytes)
            if leaf is not None:
                return region_reply(made, leaf), []
            return region_reply(made, cast(tuple, layout), self._obs_skeleton), []
        region = obs_region.current()
        if region is None or (region.slots, region.slot_bytes) != (1, nbytes):
            return {"error": "no shared observation region to use: ask for one first"}, []
        if leaf is not None and self.shm_slot is None:
            self.shm_slot = np.ndarray(leaf.shape, leaf.dtype, buffer=region.view(0))
            obs_region.on_forget(self._unshare)
        elif leaf is None and self.shm_payloads is None:
            self.shm_payloads = memory = region.view(0)
            if self._obs_skeleton is not None:
                self._slot_arrays = [
                    np.ndarray(shape, dtype, buffer=memory, offset=start)
                    for (dtype, shape), (start, _) in zip(cast(tuple, layout), self._obs_spans)
                ]
            obs_region.on_forget(self._unshare)
        region.close_fd()  # the worker has its own now
        return {"obs_region": {"in_use": True}}, []

    def _unshare(self) -> None:
        self.shm_slot = self.shm_payloads = self._slot_arrays = None  # observations go as bytes again

    def _arrays_step_reply(self, obs: Any, reward: float, terminated: bool, truncated: bool) -> bytes | None:
        """A plain step of a Dict/Tuple of arrays with a slot: each array copied into its place and
        one fixed line that refers to the whole slot as bytes (``{"__shm__": [0, "|u1",
        [slot_bytes]]}``); ``None`` (the generic path) unless every array has its space's dtype
        and shape and ``reward`` is finite."""
        places, leaf, paths = self._slot_arrays, self._slot_leaf, self._leaf_paths
        if places is None or leaf is None or paths is None or not isfinite(reward):
            return None
        arrays = paths.arrays(obs)
        if arrays is None:
            return None
        for value, place in zip(arrays, places):
            place[...] = value
        return leaf.shm_line(reward, terminated, truncated)

    def _obs_payloads_to_slot(self, reply: dict, out: list) -> None:
        """Move a Dict/Tuple observation's payloads (the first of ``out``: its obs was encoded
        first) into this env's slot, leave empty ones in their place and say so in the reply
        (``"__shm__": [0, count]``). Left as they are if they are not the layout's sizes."""
        slot, spans = self.shm_payloads, self._obs_spans
        if slot is None or len(out) < len(spans):
            return
        for (_, size), payload in zip(spans, out):
            if payload_nbytes(payload) != size:
                return
        for i, (start, size) in enumerate(spans):
            slot[start : start + size] = memoryview(out[i]).cast("B")
            out[i] = b""
        reply[SHM] = [0, len(spans)]

    def _decode_action(self, obj: Any, payloads: Sequence) -> Any:
        if self._discrete is not None and type(obj) is int and self._discrete[0] <= obj < self._discrete[1]:
            return self._discrete[2](obj)
        leaf = self._action_leaf
        if leaf is not None:
            action = leaf.decode_action(obj, payloads)
            # SyncVectorEnv hands a Box(()) env an element of the batch: a numpy scalar.
            return action[()] if not leaf.shape else action
        return decode(self.action_space, obj, payloads, copy=True, lenient=True)

    def step(self, msg: dict, payloads: Sequence) -> tuple[dict, list] | bytes:
        """Decode the action, ``env.step`` it, encode the transition; autoreset adds ``reset_obs``/``reset_info``.

        Returns ``(reply, payloads)``, or the encoded reply itself on the fast path.
        """
        autoreset = bool(msg.get("autoreset"))
        try:
            action = self._decode_action(msg.get("action"), payloads)
        except Exception:
            return self._autoreset(error_transition("action"), [], autoreset)
        return self.step_action(action, autoreset)

    def step_discrete(self, action: int, autoreset: bool = False) -> tuple[dict, list] | bytes | None:
        """The hot path of a Discrete env: step the action given as a plain int.

        ``None`` (nothing stepped) when the env's action space is not Discrete or the
        action is out of its range: the generic path then decodes, and reports, it.
        """
        discrete = self._discrete
        if discrete is None or not discrete[0] <= action < discrete[1]:
            return None
        return self.step_action(discrete[2](action), autoreset)

    def step_action(self, action: Any, autoreset: bool) -> tuple[dict, list] | bytes:
        """``env.step`` a decoded action and encode the transition (see :meth:`step`)."""
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
            reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        except Exception:
            return self._autoreset(error_transition("step"), [], autoreset)
        self.last_obs = obs
        resets_now = autoreset and (terminated or truncated)
        leaf = self._obs_leaf
        if leaf is not None and not resets_now and not info and type(info) is dict:
            slot = self.shm_slot
            if slot is not None:
                fast = leaf.shm_step_reply(obs, reward, terminated, truncated, slot)
            else:
                fast = leaf.step_reply(obs, reward, terminated, truncated)
            if fast is not None:
                return fast
        elif leaf is not None and not resets_now and type(info) is dict:  # an info: as typed columns if it fits
            fast = self._info_step_reply(leaf, obs, reward, terminated, truncated, info)
            if fast is not None:
                return fast
        elif self._slot_arrays is not None and not resets_now and not info and type(info) is dict:
            fast = self._arrays_step_reply(obs, reward, terminated, truncated)
            if fast is not None:
                return fast
        # The reset below may overwrite the env's obs buffer: copy payloads then.
        return self._transition(obs, reward, terminated, truncated, info, autoreset, zero_copy=not resets_now)

    def _info_step_reply(
        self, leaf: ArrayLeaf, obs: Any, reward: float, terminated: bool, truncated: bool, info: dict
    ) -> bytes | None:
        """A step reply whose info of numbers goes as one row of typed columns (its observation in
        the shared region where there is one, else as bytes); ``None`` (the generic path) when the
        info or the observation does not fit."""
        columns = self._info_columns
        if columns is None:
            columns = self._info_columns = InfoColumns(1)
        if not columns.put(0, info):
            return None
        version, ends = self._info_suffix
        if version != columns.version:
            member, sizes = columns.member_json(1, 1), columns.sizes(1)
            ends = (leaf.info_step_suffix(member, sizes), leaf.info_step_suffix(member, sizes, shm=True))
            self._info_suffix = (columns.version, ends)
        slot = self.shm_slot
        if slot is not None:
            return leaf.shm_step_reply(obs, reward, terminated, truncated, slot, ends[1], columns.payloads(1))
        return leaf.step_reply(obs, reward, terminated, truncated, ends[0], columns.payloads(1))

    def _transition(
        self,
        obs: Any,
        reward: float,
        terminated: bool,
        truncated: bool,
        info: Any,
        autoreset: bool,
        zero_copy: bool,
        reset_zero_copy: bool = True,
    ) -> tuple[dict, list]:
        """The reply of a step that ``env.step`` returned, through the generic encoders (and the autoreset);
        ``zero_copy``/``reset_zero_copy``: whether the step's/the autoreset's payloads may be views."""
        reply = {"obs": None, "reward": reward, "terminated": terminated, "truncated": truncated, "info": None}
        out: list = []
        try:
            reply["obs"], _ = encode(self.obs_space, obs, out, zero_copy=zero_copy)
            reply["info"], _ = encode_info(info, out, zero_copy=zero_copy)
        except Exception:
            reply, out = error_transition("encode"), []
        else:
            if self.shm_payloads is not None:
                self._obs_payloads_to_slot(reply, out)
        return self._autoreset(reply, out, autoreset, reset_zero_copy)

    def _autoreset(self, reply: dict, out: list, autoreset: bool, zero_copy: bool = True) -> tuple[dict, list]:
        """With ``autoreset``, a reply that ended the episode also carries the reset's obs/info."""
        if autoreset and (reply["terminated"] or reply["truncated"]):
            reply["reset_obs"], reply["reset_info"] = self._reset(None, None, out, zero_copy)
        return reply, out

    # -- a position of a sandbox request (a sandbox of several envs) ----------------------
    # A position is *plain* when its observation, reward, flags and info fit the sandbox reply's rows
    # (SandboxRows.put): then it is written there and the method returns None. Anything else
    # returns the one-env reply. Payloads of those are copies: another env of the process,
    # served before the reply is written, might share a buffer with this one.

    def sandbox_step(
        self, action: Any, payloads: Sequence, autoreset: bool, rows: SandboxRows | None, p: int
    ) -> tuple[dict, list] | None:
        """Step ``action`` (as a step request carries it) at position ``p`` of a sandbox request."""
        discrete = self._discrete
        if discrete is not None and type(action) is int and discrete[0] <= action < discrete[1]:
            decoded = discrete[2](action)  # what _decode_action does, without the call: the hot path
        else:
            try:
                decoded = self._decode_action(action, payloads)
            except Exception:
                return self._autoreset(error_transition("action"), [], autoreset, False)
        return self.sandbox_step_decoded(decoded, autoreset, rows, p)

    def action_row_fits(self, dtype: np.dtype, row_shape: tuple) -> bool:
        """Whether a row of a batch of actions (``dtype``, ``row_shape``) is an action of this env's
        array space, as :meth:`_decode_action` would take it: the space's shape, a numeric dtype."""
        leaf = self._action_leaf
        return leaf is not None and row_shape == leaf.shape and dtype.kind in "biuf"

    def sandbox_step_decoded(
        self, decoded: Any, autoreset: bool, rows: SandboxRows | None, p: int
    ) -> tuple[dict, list] | None:
        """:meth:`sandbox_step` of an action already decoded."""
        try:
            obs, reward, terminated, truncated, info = self.env.step(decoded)
            reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        except Exception:
            return self._autoreset(error_transition("step"), [], autoreset, False)
        if (
            rows is not None
            and type(info) is dict
            and not (autoreset and (terminated or truncated))
            and rows.put(p, obs, reward, terminated, truncated, info)
        ):
            return None
        return self._transition(obs, reward, terminated, truncated, info, autoreset, False, False)

    def sandbox_reset(self, msg: dict, rows: SandboxRows | None, p: int) -> tuple[dict, list] | None:
        """Reset as ``msg`` says at position ``p`` of a sandbox request."""
        try:
            obs, info = self._env_reset(msg.get("seed"), msg.get("options"))
        except Exception:
            return {"obs": None, "info": error_transition("reset")["info"]}, []
        if rows is not None and type(info) is dict and rows.put(p, obs, 0.0, False, False, info):
            return None
        out: list = []
        obs_j, info_j = self._encode_reset(obs, info, out, zero_copy=False)
        return {"obs": obs_j, "info": info_j}, out

    def _attr(self, name: Any) -> Any:
        if not isinstance(name, str):
            raise TypeError(f"attribute name must be a string, got {type(name).__name__}")
        env = self.env
        if hasattr(env, "get_wrapper_attr"):
            return env.get_wrapper_attr(name)
        return getattr(env, name)

    def call(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """Call the named (wrapper) attribute with args/kwargs, or return it when not callable."""
        attr = self._attr(msg.get("name"))
        args = decode_info(msg.get("args") or [], payloads, copy=True)
        kwargs = decode_info(msg.get("kwargs") or {}, payloads, copy=True)
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TypeError("call args must be a list and kwargs an object")
        value = attr(*args, **kwargs) if callable(attr) else attr
        value_j, out = encode_info(value)
        return {"value": value_j}, out

    def get_attr(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """The named (wrapper) attribute, never called."""
        value_j, out = encode_info(self._attr(msg.get("name")))
        return {"value": value_j}, out

    def set_attr(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """Set the named attribute (``set_wrapper_attr``) to the decoded value."""
        name = msg.get("name")
        if not isinstance(name, str):
            raise TypeError(f"attribute name must be a string, got {type(name).__name__}")
        value = decode_info(msg.get("value"), payloads, copy=True)
        env = self.env
        if hasattr(env, "set_wrapper_attr"):
            env.set_wrapper_attr(name, value)
        else:
            setattr(env, name, value)
        return {}, []

    def render(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """``env.render()``: an array frame crosses as an ``__nd__`` payload."""
        frame = self.env.render()
        frame_j, out = encode_info(frame, zero_copy=True)
        return {"frame": frame_j}, out

    def snapshot(self, msg: dict, payloads: Sequence) -> tuple[dict, list] | bytes:
        """The env's state as one blob (:func:`boltzlabs_gym.envside.state.snapshot_reply`); an env that
        cannot be pickled answers an error that says what to add."""
        reply = snapshot_reply(
            self.env,
            self.last_obs,
            self.started,
            process_setup.workspace_now(),
            msg.get("kind"),
            msg.get("swap"),
            process_setup.memory_snapshots(),
        )
        return b"" if reply is None else reply  # None: a memory snapshot's copy, which answers its restore

    def restore(self, msg: dict, payloads: Sequence) -> tuple[dict, list]:
        """Become the env of the blob in the request's payload (reseeded when asked); answered as a reset."""
        try:
            env, restored = restore_request(
                self.env, msg, payloads, process_setup.workspace_now(), self.last_obs, process_setup.memory_snapshots()
            )
        except SnapshotRefused as exc:
            return {"error": str(exc)}, []
        old, self.env = self.env, env
        if old is not env:
            try:
                old.close()  # the env it replaced (a window, a file) is let go of now, not at exit
            except Exception:
                _traceback()
        self.last_obs, self.started = restored["obs"], True
        out: list = []
        obs_j, info_j = self._encode_reset(restored["obs"], {}, out, zero_copy=False)
        return {"obs": obs_j, "info": info_j}, out

    def handle(self, msg: dict, payloads: Sequence) -> tuple[dict, list] | bytes | None:
        """Answer one request: ``(reply, payloads)``, an encoded reply (fast path of ``step``),
        or ``None`` for ``close`` (after closing the env)."""
        op = msg.get("op")
        if op == "step":
            return self.step(msg, payloads)
        if op == "reset":
            return self.reset(msg, payloads)
        if op == "close":
            try:
                self.env.close()
            except Exception:
                _traceback()
            return None
        handler = _OTHER_OPS.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"error": f"unknown op {op!r}"}, []
        try:
            return handler(self, msg, payloads)
        except Exception:
            return {"error": _traceback()}, []


_OTHER_OPS = {
    "describe": GymHost.describe,
    "call": GymHost.call,
    "get_attr": GymHost.get_attr,
    "set_attr": GymHost.set_attr,
    "render": GymHost.render,
    "snapshot": GymHost.snapshot,
    "restore": GymHost.restore,
    "obs_region": GymHost.obs_region,
}


def region_reply(region: obs_region.ObsRegion, leaf: ArrayLeaf | tuple, skeleton: Any = None) -> dict:
    """The answer to ``{"op": "obs_region"}``: the memfd's descriptor number in this process (for
    the worker's ``pidfd_getfd``), its size, its slots and what one slot holds: one array
    (``dtype``, ``shape``), or a Dict/Tuple observation's payloads back to back (``layout``, a
    ``[dtype, shape]`` per payload; :func:`~boltzlabs_gym.wire.slot_layout.payload_layout`), with the
    ``skeleton`` its observations all encode to when it is arrays only (then its plain steps go
    as one line, :meth:`GymHost._arrays_step_reply`)."""
    described: dict = {"fd": region.fd, "bytes": region.size, "slots": region.slots, "slot_bytes": region.slot_bytes}
    if isinstance(leaf, ArrayLeaf):
        described.update(dtype=leaf.dtype.str, shape=list(leaf.shape))
    else:
        described["layout"] = [[dtype.str, list(shape)] for dtype, shape in leaf]
        if skeleton is not None:
            described["skeleton"] = skeleton
    return {"obs_region": described}
