"""The JVM toolchains' class-data-sharing archives (code/jvm_archives.py): dumped from the language
table's own commands, mapped by them, and harmless where missing."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from boltzlabs_gym.code import CodeRunner
from boltzlabs_gym.code.jvm_archives import JVM_ARCHIVES, archive_path, build
from boltzlabs_gym.code.languages import availability, runtime_dir

JUNIT = "/usr/share/java/junit-platform-console-standalone.jar"


def _needs(*languages: str) -> None:
    found = availability()
    for language in languages:
        if found[language] is not None:
            pytest.skip(f"{language} cannot run on this host: {found[language]}")


def _from_archive(cmd: list[str]) -> int:
    """How many classes ``cmd``'s JVM loads from its top (dynamic) archive: none where it cannot use it."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    return (done.stdout + done.stderr).count("source: shared objects file (top)")


def test_build_dumps_archives_the_table_commands_can_map(tmp_path):
    _needs("java", "junit")
    made = build(str(tmp_path), languages=["java", "junit"])
    assert made == {"javac": archive_path(str(tmp_path), "javac"), "junit": archive_path(str(tmp_path), "junit")}
    for path in made.values():
        assert os.path.getsize(path) > 1 << 20
        assert os.stat(path).st_mode & 0o777 == 0o444  # read-only: programs map it, nobody writes it
    log = "-Xlog:class+load=info"
    javac = ["javac", f"-J{log}", f"-J-XX:SharedArchiveFile={made['javac']}", "-version"]
    assert _from_archive(javac) > 100
    junit = ["java", log, f"-XX:SharedArchiveFile={made['junit']}", "-jar", JUNIT, "--help"]
    assert _from_archive(junit) > 100
    # (and the count tells: javac's archive holds little of what the JUnit console loads)
    assert _from_archive(["java", log, f"-XX:SharedArchiveFile={made['javac']}", "-jar", JUNIT, "--help"]) < 100


def test_build_names_what_it_cannot_make(tmp_path):
    with pytest.raises(ValueError, match="no JVM archives for \\['cpp'\\]"):
        build(str(tmp_path), languages=["cpp"])


def test_programs_run_the_same_without_the_archives():
    """A runtime without archives (an install with --no-jvm, or one made before them): the JVM
    starts without them and prints nothing about it."""
    _needs("java")
    runtime = "/usr/nonexistent-boltzlabs-runtime"
    program = 'public class Main { public static void main(String[] a) { System.out.println("hi"); } }'
    with CodeRunner(envs_per_lane=1, lanes=1, env_vars={"BOLTZLABS_CODE_RUNTIME": runtime}) as r:
        result = r.run(program, language="java", compile_timeout=60, run_timeout=60)
    assert result.status == "Success" and result.stdout == "hi\n", result.stderr
    assert result.stderr == "" and result.compile_result.stderr == ""


def test_the_installed_archives_map_inside_the_sandbox():
    """Where ``code-runtime install`` made them, a program's JVM in the sandbox maps them."""
    _needs("java")
    missing = [n for n in JVM_ARCHIVES if not os.path.exists(archive_path(runtime_dir(), n))]
    if "javac" in missing:
        pytest.skip(f"no JVM archives in {runtime_dir()}: run boltzlabs-gym code-runtime install")
    archive = archive_path(runtime_dir(), "javac")
    check = f"javac -J-Xlog:class+load=info -J-XX:SharedArchiveFile={archive} -version | grep -c '(top)'"
    with CodeRunner(envs_per_lane=1, lanes=1) as r:
        result = r.run(check, language="bash", run_timeout=60)
    assert result.status == "Success" and int(result.stdout) > 100, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("java") is None, reason="no java on this host (Debian: default-jdk-headless)")
def test_every_archive_is_mapped_by_some_table_command():
    from boltzlabs_gym.code.languages import _TABLE

    flags = {part for spec in _TABLE.LANGUAGES.values() for c in (spec.compile, spec.run) if c for part in c}
    for name in JVM_ARCHIVES:
        assert any(f"/jvm/{name}.jsa" in flag for flag in flags), name
