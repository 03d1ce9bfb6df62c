"""The rules the worker and a local pool's lane share, and the lending words on the wire."""

from __future__ import annotations

import ast
import sys

from boltzlabs_gym.wire import call_rules as lending
from boltzlabs_gym.wire import protocol
from boltzlabs_gym.client.direct_lane import DirectLane
from boltzlabs_gym.worker.session import Session, SessionConfig


def test_a_step_has_the_step_timeout_and_every_other_op_the_reset_timeout():
    timeouts = lending.OpTimeouts(step_timeout=0.5, reset_timeout=7.0)
    assert [timeouts[op] for op in ("step", "reset", "hard_reset", "custom")] == [0.5, 7.0, 7.0, 7.0]
    assert "reset" not in timeouts, "a lookup adds nothing to the table"


def test_lane_and_worker_session_time_calls_by_the_same_table(tmp_path):
    lane = DirectLane(step_timeout=0.5, reset_timeout=7.0)
    try:
        session = Session("s1", b"c", str(tmp_path), str(tmp_path), SessionConfig(n=1, step_timeout=0.5,
                                                                                  reset_timeout=7.0), None)
        for op in ("step", "reset", "hard_reset", "custom"):
            assert lane._timeouts[op] == session.timeouts[op]
    finally:
        lane.close()


def test_deadline_messages_and_stray_output():
    assert lending.missed_deadline(1.0, "step", 1.234) == "missed the 1 s deadline for 'step' (waited 1.23 s); killed"
    assert lending.missed_deadline(60.0, None, 60.5).startswith("missed the 60 s deadline for its start-up")
    assert lending.is_straggler_op("step") and not lending.is_straggler_op("reset")
    assert lending.leftover_is_stray(replied=True, idle=False)
    assert lending.leftover_is_stray(replied=False, idle=True)
    assert not lending.leftover_is_stray(replied=False, idle=False), "the rest of the awaited reply"


def test_lending_words_on_the_wire_keep_their_spelling():
    """An older pool and a newer worker (or the other way round) must still understand each other."""
    assert (protocol.LEND, protocol.LENT, protocol.FAULTS, protocol.ADOPT, protocol.LENT_FAULT) == (
        "lend", "lent", "faults", "adopt", "lent_fault")
    assert protocol.LENT_FDS == "_fds"
    for name in ("LEND", "LENT", "LENT_FDS", "FAULTS", "ADOPT", "LENT_FAULT"):
        assert f":data:`{name}`" in protocol.__doc__, f"{name} is documented in the protocol's Lending section"


def test_the_shared_rules_need_only_the_standard_library():
    tree = ast.parse(open(lending.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative and imported <= sys.stdlib_module_names | {"__future__"}, imported


def test_the_sandbox_deadline_key_is_the_wire_s():
    """lending stands alone (above), so it spells the sandbox request deadline's key itself: the same as the wire's."""
    assert lending._DEADLINE_KEY == protocol.SANDBOX_DEADLINE
