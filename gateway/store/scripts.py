"""Loads the Lua scripts of ``gateway/store/lua/`` and calls them by SHA.

Each file is one atomic operation. ``_lib.lua`` holds helpers shared by all of
them; it is spliced in after each script's ``#!lua`` line (the shebang must
stay first: it makes Redis refuse a script under OOM before any write).
"""

from __future__ import annotations

from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

SCRIPT_NAMES = (
    "start_run",
    "start_batch",
    "complete_step",
    "end_run",
    "cancel_key",
    "repoint",
    "sweep",
    "take_step",
    "step_failed",
    "extend_lease",
    "start_due",
    "record_deliveries",
    "list_deliveries",
    "ingress",
)


def script_source(name: str) -> str:
    """The full text sent to Redis for one script."""
    lua = resources.files("gateway.store") / "lua"
    lib = (lua / "_lib.lua").read_text()
    shebang, _, body = (lua / f"{name}.lua").read_text().partition("\n")
    if not shebang.startswith("#!lua"):
        raise RuntimeError(f"gateway/store/lua/{name}.lua must start with '#!lua'")
    return f"{shebang}\n{lib}\n{body}"


class Scripts:
    """The registered scripts. redis-py's ``AsyncScript`` computes each SHA
    locally, calls EVALSHA and reloads the script on NOSCRIPT by itself."""

    def __init__(self, redis: Redis) -> None:
        self.start_run: AsyncScript = redis.register_script(script_source("start_run"))
        self.start_batch: AsyncScript = redis.register_script(script_source("start_batch"))
        self.complete_step: AsyncScript = redis.register_script(script_source("complete_step"))
        self.end_run: AsyncScript = redis.register_script(script_source("end_run"))
        self.cancel_key: AsyncScript = redis.register_script(script_source("cancel_key"))
        self.repoint: AsyncScript = redis.register_script(script_source("repoint"))
        self.sweep: AsyncScript = redis.register_script(script_source("sweep"))
        self.take_step: AsyncScript = redis.register_script(script_source("take_step"))
        self.step_failed: AsyncScript = redis.register_script(script_source("step_failed"))
        self.extend_lease: AsyncScript = redis.register_script(script_source("extend_lease"))
        self.start_due: AsyncScript = redis.register_script(script_source("start_due"))
        # The delivery log (gateway/deliveries/log.py).
        self.record_deliveries: AsyncScript = redis.register_script(
            script_source("record_deliveries")
        )
        self.list_deliveries: AsyncScript = redis.register_script(script_source("list_deliveries"))
        # The per-path ingress limit, asked before a delivery is read (gateway/store/ingress.py).
        self.ingress: AsyncScript = redis.register_script(script_source("ingress"))

    def all(self) -> tuple[AsyncScript, ...]:
        return (
            self.start_run,
            self.start_batch,
            self.complete_step,
            self.end_run,
            self.cancel_key,
            self.repoint,
            self.sweep,
            self.take_step,
            self.step_failed,
            self.extend_lease,
            self.start_due,
            self.record_deliveries,
            self.list_deliveries,
            self.ingress,
        )
