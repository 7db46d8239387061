"""One trigger's YAML, compiled alone: how the tests of a trigger's options build one,
and read the error that names a wrong field."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import yaml

from gateway.ingest.triggers import Trigger, parse_triggers
from gateway.model.errors import ConfigError

# A trigger `t` of workflow `deploy`, unsigned, its event id at $.id; the tests add lines.
BASE = """
t:
  workflow: deploy
  path: /hooks/x
  verify: {scheme: none}
  event_id: {jsonpath: $.id}
"""


def compiled(extra: str, env: Mapping[str, str] | None = None, base: str = BASE) -> Trigger:
    """Trigger `t` with ``extra`` (YAML lines, each after the first indented by two
    spaces) added to ``base``."""
    raw = yaml.safe_load(base + f"  {extra}\n")
    return parse_triggers(raw, file="t.yaml", workflows=("deploy",), env=env or {})["t"]


def refusal(extra: str, env: Mapping[str, str] | None = None, base: str = BASE) -> str:
    """The text of the ConfigError that trigger `t` with ``extra`` is refused with."""
    with pytest.raises(ConfigError) as refused:
        compiled(extra, env, base)
    return str(refused.value)
