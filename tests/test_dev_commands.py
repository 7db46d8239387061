"""The README's development commands pass as written on a fresh install: the linters
it names are run here, the test commands name markers that exist, and the test extra
pins ruff to the release whose style the code is formatted in."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment's scripts: ruff, lint-imports


def development_commands() -> list[str]:
    """The commands of the README's Development section's first code block, without
    their comments."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Development\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n((?:    \S.*\n)+)", section)
    assert block, "no indented command block under ## Development"
    return [line.strip().split("  #")[0].strip() for line in block.group(1).splitlines()]


def test_the_linters_the_readme_names_pass() -> None:
    linters = [c for c in development_commands() if c.startswith(("ruff", "lint-imports"))]
    assert any("ruff format --check" in c for c in linters), linters
    assert any(c.startswith("lint-imports") for c in linters), linters
    for command in linters:
        done = subprocess.run(
            ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(Path.home())},
        )  # fmt: skip
        assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"


def test_the_test_commands_name_markers_that_exist() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    tests = [c for c in development_commands() if "pytest" in c]
    assert tests, "no pytest command in the README"
    for command in tests:
        words = shlex.split(command)
        options = words[words.index("pytest") + 1 :]  # not python's own -m
        if "-m" in options:
            expression = options[options.index("-m") + 1]
            named = set(re.findall(r"\w+", expression)) - {"not", "and", "or"}
            assert named <= markers, f"{command}: unknown markers {named - markers}"


def test_ruff_is_pinned_to_the_minor_release_installed() -> None:
    """ruff changes its formatting style in minor releases: an open range would let a
    fresh install reformat the code and fail `ruff format --check`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = [
        Requirement(r) for r in config["project"]["optional-dependencies"]["test"]
        if Requirement(r).name == "ruff"
    ]  # fmt: skip
    version = subprocess.run(
        [sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    assert pin.specifier.contains(version), f"ruff {version} installed; test extra has {pin}"
    uppers = [s.version for s in pin.specifier if s.operator == "<"]
    major, minor = version.split(".")[:2]
    assert uppers == [f"{major}.{int(minor) + 1}"], f"{pin}: no upper bound at the next minor"
