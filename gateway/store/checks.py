"""What the store checks of the server and of the stored data before it serves: that
each workflow's ``partitions`` is the one its data is stored with (``check_layout``),
that the server answers (``ping``), and that every script loads (``load_scripts``).

Apart from the rest because these are checks, not operations on runs: the listener,
a reload and the CLI check the layout before they use the store, and the app loads
the scripts at start-up, and checks them on every readiness probe (gateway/serving/app.py).
"""

from __future__ import annotations

from gateway.link.cluster_client import ping_every_primary
from gateway.model.errors import ConfigError
from gateway.store.base import StoreBase
from gateway.store.keys import Keys


class StoreChecks(StoreBase):
    """The store's start-up and readiness checks."""

    async def check_layout(self, *, record: bool = True) -> None:
        """Refuse a ``partitions`` that differs from the one the workflow's data is stored
        with (ConfigError): its keys would be looked for under other hash tags, and
        every promise about them lost. There is no migration: change N on an empty
        workflow, or under a new workflow name. With ``record`` (the listener, a CLI
        command that starts runs) the first use records N; without, nothing is
        written (a dry run, a read)."""
        async with self.deadline():
            for name, wf in self.config.workflows.items():
                meta = Keys(self.prefix, name).meta()
                stored = await self._retrying(lambda m=meta: self.redis.hget(m, "partitions"))
                if stored is None:
                    # No record yet: data stored before partitions existed is in {wf}.
                    if wf.partitions > 1:
                        old = Keys(self.prefix, name).runs()
                        if await self._retrying(lambda k=old: self.redis.exists(k)):
                            stored = b"1"
                    if stored is None and record:
                        await self._retrying(
                            lambda m=meta, n=wf.partitions: self.redis.hsetnx(m, "partitions", n)
                        )
                        stored = await self._retrying(
                            lambda m=meta: self.redis.hget(m, "partitions")
                        )
                if stored is not None and int(stored) != wf.partitions:
                    raise ConfigError(
                        self.config.file,
                        f"the store holds this workflow's data with partitions: "
                        f"{int(stored)}; changing it to {wf.partitions} is refused (there is "
                        "no migration: keep it, or use a new workflow name)",
                        section="workflow",
                        name=name,
                        field="partitions",
                    )

    async def ping(self) -> None:
        """The server answers; on a cluster, every primary does (each slot has a home)."""
        async with self.deadline():
            await self._retrying(lambda: ping_every_primary(self.redis))

    async def ensure_scripts(self) -> None:
        """Every script is in the server's cache: one SCRIPT EXISTS, and a SCRIPT LOAD of
        those missing only (a server restarted or flushed). The readiness probe's check,
        asked every few seconds by every worker: it costs Redis one command."""
        scripts = self.scripts.all()
        async with self.deadline():
            cached = await self._retrying(
                lambda: self.redis.script_exists(*(script.sha for script in scripts))
            )
            for script, there in zip(scripts, cached, strict=True):
                if not there:
                    await self._retrying(
                        lambda script=script: self.redis.script_load(script.script)
                    )

    async def load_scripts(self) -> None:
        """Load every script now, so a broken script or server fails at start-up."""
        async with self.deadline():
            for script in self.scripts.all():
                await self._retrying(lambda script=script: self.redis.script_load(script.script))
