"""PoolOptions: every pool setting in one frozen, checked object, and the faces that take it.

Most of these start no pool: settings are checked before anything is started. One test starts a
small pool to see what a pool runs with when it gets both ``options=`` and keywords.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import typing

import pytest

import boltzlabs_gym
from boltzlabs_gym import Limits, PoolOptions, RLPool
from boltzlabs_gym.aio import AsyncPool
from boltzlabs_gym.cli import build_parser
from boltzlabs_gym.cli.code_server import POOL_SETTINGS
from boltzlabs_gym.cli.pool_flags import flag_of, pool_settings_from
from boltzlabs_gym.client.options import SETTINGS, UNSET, PoolSettings, Unset, field_docs
from boltzlabs_gym.code import AsyncCodeRunner, CodeRunner
from boltzlabs_gym.code.runner import RunnerSettings
from boltzlabs_gym.integrations.grading import Grader
from boltzlabs_gym.integrations.leases import EnvLeases
from boltzlabs_gym.wire.keys import ClientKeys
from boltzlabs_gym.wire.protocol import DEFAULT_BUSY_POLL_US, DEFAULT_SNAPSHOT_BUDGET, WORKER_FLAGS
from boltzlabs_gym.worker.flags import worker_parser
from conftest import COUNTER, ISOLATION

#: (setting, a value it refuses, the exception): one per setting the pool checks itself.
REFUSED = [
    ("isolation", None, ValueError),  # a name the worker has no backend of, the worker refuses
    ("mode", "fast", ValueError),
    ("step_timeout", 0, ValueError),
    ("reset_timeout", -1.0, ValueError),
    ("start_timeout", "60", ValueError),
    ("limits", {"memory_bytes": 1}, TypeError),
    ("serialize_measurement", 1, ValueError),
    ("env_vars", {"PATH": 1}, ValueError),
    ("keys", 42, TypeError),
    ("split", [2, -1], ValueError),
    ("heartbeat_interval", 0, ValueError),
    ("heartbeat_timeout", 0.5, ValueError),  # not more than heartbeat_interval (1 s)
    ("lease", 0, ValueError),
    ("busy_poll_us", -1, ValueError),
    ("env_aslr", "yes", ValueError),
    ("env_python", "python3", ValueError),  # not an absolute path (the worker checks the rest)
    ("nested_user_namespaces", 1, ValueError),
    ("direct", None, ValueError),
    ("shared_obs", 0, ValueError),
    ("envs_per_sandbox", 0, ValueError),
    ("metrics_port", 70000, ValueError),
    ("snapshot_budget", -1, ValueError),
    ("worker_loss", "ignore", ValueError),
]


@pytest.mark.parametrize(("name", "value", "error"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_setting_is_named_in_the_error(name, value, error):
    with pytest.raises(error, match=name):
        PoolOptions(**{name: value})
    # A pool refuses it too, before it starts anything (there is no env directory here).
    with pytest.raises(error, match=name):
        RLPool("/nonexistent", 2, **{name: value})


def test_every_setting_has_its_check():
    assert [r[0] for r in REFUSED] == list(SETTINGS)


def test_settings_that_depend_on_each_other_are_checked_together():
    with pytest.raises(ValueError, match="heartbeat_timeout must be greater than heartbeat_interval"):
        PoolOptions(heartbeat_interval=5, heartbeat_timeout=4)
    with pytest.raises(ValueError, match="multiples of envs_per_sandbox"):
        PoolOptions(envs_per_sandbox=2, split=[3, 1])
    with pytest.raises(ValueError, match="worker_loss='report'.*envs_per_sandbox=1"):
        PoolOptions(worker_loss="report", envs_per_sandbox=2)


def test_settings_are_checked_against_where_the_pool_runs():
    options = PoolOptions(split=[1, 1])
    assert options.placed(2, ["tcp://a:1", "tcp://b:1"]).split == (1, 1)
    with pytest.raises(ValueError, match="split must give one count per worker and sum to n=3"):
        options.placed(3, ["tcp://a:1", "tcp://b:1"])
    with pytest.raises(ValueError, match="split"):
        options.placed(2, None)
    with pytest.raises(ValueError, match="snapshot_budget is for the pool's own local worker.*--snapshot-budget"):
        PoolOptions(snapshot_budget=10).placed(1, ["tcp://a:1"])
    with pytest.raises(ValueError, match="metrics_port is for the pool's own local worker.*--metrics-port"):
        PoolOptions(metrics_port=0).placed(1, ["tcp://a:1"])
    with pytest.raises(ValueError, match="worker_loss='report' is for remote workers"):
        PoolOptions(worker_loss="report").placed(1, None)
    with pytest.raises(ValueError, match="n must be a positive int"):
        PoolOptions().placed(0, None)


def test_placed_resolves_what_depends_on_the_workers():
    class Source:
        sandboxed_only = True

    assert PoolOptions().placed(1, None).worker_loss == "raise"
    from_source = PoolOptions().placed(1, ["tcp://a:1"], source=Source())
    assert (from_source.worker_loss, from_source.isolation) == ("report", "strict")
    assert PoolOptions(isolation="process").placed(1, ["tcp://a:1"], source=Source()).isolation == "process"
    assert PoolOptions(envs_per_sandbox=2).placed(2, ["tcp://a:1"], source=Source()).worker_loss == "raise"


def test_defaults_live_in_pool_options_only():
    """No face that builds a pool has a parameter of a pool setting's name (with a default of its
    own): each takes ``options`` and ``**settings`` and hands one PoolOptions on."""
    from boltzlabs_gym.sb3 import BoltzLabsSB3VecEnv, make_sb3_vec_env

    faces = [RLPool, AsyncPool, BoltzLabsSB3VecEnv, make_sb3_vec_env, CodeRunner, AsyncCodeRunner, Grader, EnvLeases]
    for face in faces:
        params = inspect.signature(face).parameters
        assert not set(params) & set(SETTINGS), face
        assert params[next(reversed(params))].kind is inspect.Parameter.VAR_KEYWORD, face
    assert PoolOptions() == PoolOptions.fold(None, {})
    assert PoolOptions().limits == Limits() and PoolOptions().busy_poll_us == DEFAULT_BUSY_POLL_US


def test_a_keyword_overrides_the_options_field():
    options = PoolOptions(mode="boltz", step_timeout=5)
    folded = PoolOptions.fold(options, {"step_timeout": 7, "reset_timeout": 9})
    assert (folded.mode, folded.step_timeout, folded.reset_timeout) == ("boltz", 7.0, 9.0)
    assert options.step_timeout == 5.0  # the object given is left as it was
    assert PoolOptions.fold(options, {}) is options
    # The keyword is checked as it overrides: a pool refuses it before it starts anything.
    with pytest.raises(ValueError, match="step_timeout"):
        RLPool("/nonexistent", 2, options=options, step_timeout=0)
    with pytest.raises(TypeError, match="options must be a PoolOptions"):
        RLPool("/nonexistent", 2, options={"step_timeout": 5})  # type: ignore[arg-type]


def test_a_pool_runs_with_its_options_and_the_keywords_over_them(no_leaks):
    options = PoolOptions(isolation=ISOLATION, step_timeout=5, reset_timeout=20)
    with RLPool(COUNTER, n=1, options=options, reset_timeout=25, direct=False) as pool:
        assert pool.options == dataclasses.replace(options, reset_timeout=25, direct=False, worker_loss="raise")
        assert (pool.step_timeout, pool.reset_timeout) == (5.0, 25.0)
        pool.reset(seed=0)
        obs, rewards, dones, infos = pool.step([1])
        assert len(obs) == 1


def test_an_unknown_keyword_is_named_with_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown pool setting 'stepp_timeout'; the pool's settings are: isolation, "):
        RLPool("/nonexistent", 2, stepp_timeout=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unknown pool settings 'a', 'b'"):
        PoolOptions.fold(None, {"b": 1, "a": 2})
    # The faces fold their keywords the same way, before they start anything.
    with pytest.raises(TypeError, match="stepp_timeout"):
        AsyncPool("/nonexistent", n=2, stepp_timeout=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="stepp_timeout"):
        CodeRunner(stepp_timeout=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="stepp_timeout"):
        EnvLeases(stepp_timeout=5)  # type: ignore[call-arg]


def test_faces_refuse_what_they_set_themselves_or_cannot_use():
    with pytest.raises(TypeError, match="CodeRunner sets mode and step_timeout itself"):
        CodeRunner(mode="default", step_timeout=1)
    with pytest.raises(ValueError, match="envs_per_sandbox must be 1"):
        CodeRunner(options=PoolOptions(envs_per_sandbox=2))
    with pytest.raises(TypeError, match="EnvLeases sets mode itself"):
        EnvLeases(mode="default")
    with pytest.raises(TypeError, match=r"AsyncCodeRunner\(runner=...\) takes no settings.*lanes"):
        AsyncCodeRunner(runner=object(), lanes=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Grader\(runner\) takes no settings.*isolation"):
        Grader(object(), isolation="process")  # type: ignore[arg-type]


def test_a_frozen_options_object_cannot_be_changed():
    options = PoolOptions(env_vars={"A": "1"}, split=[1, 1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.step_timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.env_vars["B"] = "2"  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        options.env_vars.update(B="2")  # type: ignore[attr-defined]
    assert options.split == (1, 1)
    assert dataclasses.replace(options, step_timeout=1).step_timeout == 1.0


def test_options_pickle_and_hash_as_values():
    """An options object travels (to a Ray actor, a subprocess) and can key a cache."""
    options = PoolOptions(mode="boltz", env_vars={"A": "1"}, split=[1, 1], limits=Limits(memory_bytes=1 << 30))
    copy = pickle.loads(pickle.dumps(options))
    assert copy == options and hash(copy) == hash(options)
    assert copy.env_vars == {"A": "1"}
    with pytest.raises(TypeError, match="read-only"):
        copy.env_vars["B"] = "2"  # type: ignore[index]


def test_pool_settings_mirror_the_fields():
    """``**settings: Unpack[PoolSettings]`` types every face's keywords: same names, same types."""
    fields = typing.get_type_hints(PoolOptions)
    assert list(typing.get_type_hints(PoolSettings)) == list(fields) == list(SETTINGS)
    assert typing.get_type_hints(PoolSettings) == fields
    assert PoolSettings.__required_keys__ == frozenset()


def test_make_vec_takes_every_setting_as_a_typed_parameter():
    """``make_vec``'s ``**kwargs`` are the env's own (as ``gymnasium.make_vec``'s), so the pool's
    settings are explicit parameters there: one per field, the field's type or ``UNSET``."""
    hints = typing.get_type_hints(boltzlabs_gym.make_vec)
    params = inspect.signature(boltzlabs_gym.make_vec).parameters
    fields = typing.get_type_hints(PoolOptions)
    assert [name for name in params if name in fields] == list(SETTINGS)
    for name in SETTINGS:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is UNSET, name
        assert hints[name] == fields[name] | Unset, name
    assert params["env_kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_make_vec_hands_on_only_the_settings_it_was_given(no_leaks):
    options = PoolOptions(isolation=ISOLATION, step_timeout=5, reset_timeout=20)
    envs = boltzlabs_gym.make_vec("CartPole-v1", 1, options=options, reset_timeout=25, direct=False)
    try:
        assert envs.pool.options == dataclasses.replace(options, reset_timeout=25, direct=False, worker_loss="raise")
        envs.reset(seed=0)
    finally:
        envs.close()


def test_mypy_sees_what_the_faces_are_given(tmp_path):
    """A setting of the wrong type is a type error at every face that builds a pool."""
    api = pytest.importorskip("mypy.api", reason="mypy is not installed: pip install -e '.[lint]'")
    user = tmp_path / "user.py"
    user.write_text(
        "import boltzlabs_gym\n"
        "from boltzlabs_gym.aio import AsyncPool\n"
        "boltzlabs_gym.make_vec('CartPole-v1', 2, step_timeout='5')\n"
        "boltzlabs_gym.make_vec('CartPole-v1', 2, envs_per_sandbox=2, mode='boltz', render_mode=None)\n"
        "boltzlabs_gym.RLPool('envs/x', 2, envs_per_sandbox='2')\n"
        "AsyncPool('envs/x', 2, limits=3)\n"
    )
    out, _, status = api.run(["--no-incremental", "--follow-imports=silent", "--cache-dir=/dev/null", str(user)])
    errors = sorted(int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line)
    assert status == 1 and errors == [3, 5, 6], out


def test_runner_settings_mirror_the_code_runners_parameters():
    runner = typing.get_type_hints(CodeRunner.__init__)
    runner = {name: kind for name, kind in runner.items() if name not in ("settings", "return")}
    own = {name: kind for name, kind in typing.get_type_hints(RunnerSettings).items() if name not in SETTINGS}
    assert own == runner


def test_every_field_has_its_doc():
    docs = field_docs()
    assert list(docs) == list(SETTINGS)
    assert all(len(doc) > 20 for doc in docs.values()), docs


def test_the_worker_config_comes_from_the_options():
    options = PoolOptions(
        mode="boltz", env_vars={"A": "1"}, limits=Limits(memory_bytes=1 << 30), metrics_port=0, snapshot_budget=5
    )
    local = options.worker_config(remote=False)
    assert local.session == {
        "isolation": "auto",
        "mode": "boltz",
        "limits": Limits(memory_bytes=1 << 30).to_json(),
        "step_timeout": 30.0,
        "reset_timeout": 60.0,
        "start_timeout": 120.0,
        "serialize_measurement": False,
        "env_vars": {"A": "1"},
        "env_aslr": False,
        "env_python": None,
        "nested_user_namespaces": False,
        "envs_per_sandbox": 1,
        "lease_s": 86400.0,
    }
    busy_poll = ["--busy-poll-us", repr(DEFAULT_BUSY_POLL_US)]
    assert local.flags == [*busy_poll, "--metrics-port", "0", "--snapshot-budget", "5"]
    assert options.worker_config(remote=True).session["lease_s"] == 600.0
    assert PoolOptions().worker_config(remote=False).flags == busy_poll


def test_the_worker_parser_takes_the_flags_the_pool_gives_its_worker():
    """One mapping (setting -> flag) for the pool and the worker's parser; the worker reads each
    flag into the setting's name, and its default is the pool's where the pool has one."""
    parser = worker_parser()
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
    for name, flag in WORKER_FLAGS.items():
        assert name in SETTINGS
        assert by_flag[flag].dest == name
    assert by_flag[WORKER_FLAGS["busy_poll_us"]].default == PoolOptions().busy_poll_us
    assert by_flag[WORKER_FLAGS["snapshot_budget"]].default == DEFAULT_SNAPSHOT_BUDGET
    flags = PoolOptions(busy_poll_us=50, metrics_port=0, snapshot_budget=7).worker_config(remote=False).flags
    args = parser.parse_args(["--bind", "ipc:///tmp/x.sock", *flags])
    assert (args.busy_poll_us, args.metrics_port, args.snapshot_budget) == (50.0, 0, 7)


def test_the_code_servers_pool_flags_come_from_the_fields():
    parser = build_parser()
    args = parser.parse_args(
        ["code-server", "--reset-timeout", "5", "--no-direct", "--isolation", "process", "--keys", "/k"]
    )
    settings = pool_settings_from(args, POOL_SETTINGS)
    assert settings == {"reset_timeout": 5.0, "direct": False, "isolation": "process", "keys": "/k"}
    assert PoolOptions(**settings).reset_timeout == 5.0
    assert pool_settings_from(parser.parse_args(["code-server"]), POOL_SETTINGS) == {}
    help_text = next(a for a in parser._subparsers._actions if a.choices).choices["code-server"].format_help()
    for name in POOL_SETTINGS:
        assert flag_of(name) in help_text
    assert "Deadline in seconds for resets and other calls" in help_text


def test_client_keys_are_a_setting_like_any_other():
    keys = ClientKeys(b"0" * 40, b"1" * 40, b"2" * 40)
    assert PoolOptions(keys=keys).keys is keys
