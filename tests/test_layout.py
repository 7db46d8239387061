"""The package's shape, checked: capabilities in layers that import only downwards,
no import cycle anywhere, and modules small enough to own one thing.

The layers live in pyproject.toml (``[tool.importlinter]``); ``lint-imports`` reads
every import of gateway/, those inside functions and under TYPE_CHECKING included.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gateway"
# A module past this many lines is doing several things; split it where a seam shows.
MAX_MODULE_LINES = 600
# gateway/ itself holds the public face and little else: the rest is in subpackages.
MAX_TOP_MODULES = 8


def contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def test_imports_keep_the_contracts() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "broken" not in done.stdout.lower().replace("0 broken", "")


def test_every_capability_is_a_layer() -> None:
    """A new subpackage must take its place in the layers, or the contract would not
    see it at all."""
    (layers,) = [c["layers"] for c in contracts() if c["type"] == "layers"]
    named = {name.strip() for layer in layers for name in str(layer).split("|")}
    assert len(layers) >= 5
    found = {f"gateway.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
    found |= {
        f"gateway.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")
    }
    assert found == named, f"not in the layers: {found - named}; gone: {named - found}"


def test_modules_own_one_thing() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    large = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not large, f"modules over {MAX_MODULE_LINES} lines: {large}"
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
