"""The framework-free grader: both test styles, one round trip per batch, and bad input as scores."""

from __future__ import annotations

import asyncio
import json
import time

from conftest import ADD, ADD_TESTS, LOOP

from boltzlabs_gym.integrations.grading import Grader, extract_code


def test_asserts_stdio_and_fences_in_one_batch(grader):
    stdio = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3", "10\n"]}
    completions = [
        f"Here:\n```python\n{ADD}```\n",
        "def add(a, b):\n    return a * b\n",  # passes add(2, 2) == 4 alone
        "```\na, b = map(int, input().split())\nprint(a + b)\n```",
        [{"role": "assistant", "content": ADD}],
    ]
    verdicts = grader.grade(completions, [ADD_TESTS, json.dumps(ADD_TESTS), stdio, [*ADD_TESTS["assert_case"]]])
    assert [v.score for v in verdicts] == [1.0, 1 / 3, 1.0, 1.0]
    assert all(v.reason == "graded" for v in verdicts)


def test_bad_input_is_a_documented_score_never_an_exception(grader):
    loud = "print('x' * (8 << 20))\n" + ADD
    t0 = time.perf_counter()
    verdicts = grader.grade(
        [None, ADD, ADD, LOOP, loud, ADD],
        [ADD_TESTS, "not json", {"inputs": ["1"], "outputs": []}, ADD_TESTS, ADD_TESTS, {"assert_case": []}],
    )
    assert time.perf_counter() - t0 < 15, "the looping program was not killed on its deadline"
    assert [v.score for v in verdicts] == [0.0, None, None, 0.0, 1.0, None]
    assert "not text" in verdicts[0].reason and "JSON" in verdicts[1].reason and "1 inputs but 0" in verdicts[2].reason
    assert verdicts[3].statuses == ["TimeLimitExceeded"] * 3


def test_async_plain_callable_and_a_closed_runner(grader):
    assert asyncio.run(grader([ADD, "x = 1"], [ADD_TESTS, ADD_TESTS])) == [1.0, 0.0]
    shared = Grader(grader.runner)
    shared.close()  # a grader given a runner leaves it open
    assert shared.grade([ADD], [ADD_TESTS])[0].score == 1.0
    own = Grader(envs_per_lane=1, lanes=1)
    own.close()
    [verdict] = own.grade([ADD], [ADD_TESTS])
    assert verdict.score is None and "runner unavailable" in verdict.reason
    [verdict] = asyncio.run(own.grade_async([ADD], [ADD_TESTS]))
    assert verdict.score is None and "runner unavailable" in verdict.reason


def test_extract_code_takes_the_last_python_block():
    text = "```bash\nls\n```\n```python\nprint(1)\n```\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n" and extract_code(42) is None and extract_code([]) is None
