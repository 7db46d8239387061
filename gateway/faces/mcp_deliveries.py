"""The MCP tools for the delivery log: list what the webhook listener answered, show
one delivery, and replay a stored one through the triggers as they are now.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult
from pydantic import Field

from gateway.deliveries import log as deliveries
from gateway.deliveries.text import SINCE_HELP, list_lines, parse_since, record_text, replay_text
from gateway.deliveries.text import check_cursor as check_delivery_cursor
from gateway.faces.mcp_calls import page_text, run_tool
from gateway.ingest.served import Serving
from gateway.loading import load_config
from gateway.model.config import Config
from gateway.model.errors import ConfigError, RealmError
from gateway.store.runstore import RunStore

__all__ = ["add_delivery_tools"]

OutcomeArg = Literal[deliveries.OUTCOMES]  # type: ignore[valid-type]
DeliveryId = Annotated[
    str, Field(description="The delivery's id (dlv-…), as list_deliveries printed it.")
]


def add_delivery_tools(server: MCPServer[RunStore]) -> None:
    """Register the three delivery-log tools on ``server``."""

    @server.tool(
        description="List the delivery log (what the webhook listener answered), newest "
        "first, one line per delivery: id, time, status, path, the reply's error code if "
        "any, and each trigger's outcome (started, queued (behind its key's live runs), "
        "scheduled (debounce, delay), deduplicated, refused, ignored, "
        "unverified, stale (an ordered trigger's event older than one already started), "
        "rate_limited (past its trigger's rate limit), handshake (a sender's endpoint "
        "check, answered), "
        "or accepted: kept in the spool while Redis could not take it, its "
        "claims not yet made). Filter by "
        "path, status (202 or a class like 4xx), outcome, since. When there may be more, "
        "the last line is 'cursor: ...': pass it back as cursor for the next page (under "
        "a filter a page may be short, even empty, and still have one)."
    )
    async def list_deliveries(
        ctx: Context,
        path: Annotated[str | None, Field(description="Only deliveries to this path.")] = None,
        status: Annotated[
            str | None, Field(description="Only this status (202) or class (4xx).")
        ] = None,
        outcome: Annotated[
            OutcomeArg | None,
            Field(description="Only deliveries where at least one trigger had this outcome."),
        ] = None,
        since: Annotated[
            str | None, Field(description=f"Only deliveries received since: {SINCE_HELP}.")
        ] = None,
        limit: Annotated[int, Field(ge=1, le=1000, description="Deliveries per page.")] = 20,
        cursor: Annotated[
            str | None, Field(description="The cursor a previous page returned.")
        ] = None,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            since_ms = None if since is None else parse_since(since, int(time.time() * 1000))
            where = deliveries.DeliveryFilter(
                path=path, status=status, outcome=outcome, since_ms=since_ms
            )
            page, next_cursor = await deliveries.list_deliveries(
                store, where, limit=limit, cursor=check_delivery_cursor(cursor)
            )
            return page_text(list_lines(page), next_cursor, empty="no deliveries")

        return await run_tool(ctx, work)

    @server.tool(
        description="Show one delivery of the log: status, each trigger's outcome and why "
        "(not matched: which condition; refused: the code), the run it started or matched, "
        "the headers as kept (never a signature or token) and the body."
    )
    async def get_delivery(ctx: Context, delivery_id: DeliveryId) -> CallToolResult:
        async def work(store: RunStore) -> str:
            return record_text(await deliveries.get_delivery(store, delivery_id))

        return await run_tool(ctx, work)

    @server.tool(
        description="Send a stored delivery through matching again, with the triggers of "
        "triggers.yaml as the file is now (after fixing a trigger that ignored it, say), "
        "recorded as a replay of it. Its signature is not kept: only the triggers that "
        "verified it on arrival, under the same verify spec as now, may start runs; the "
        "others answer unverified, saying why. By default the triggers' "
        "policies apply: a replay of a delivery that started a run is deduplicated to that "
        "run. rerun: true starts a new run for each matched trigger (rerun_of the old one). "
        "Needs the webhook secrets in this server's environment, as the listener does."
    )
    async def replay_delivery(
        ctx: Context,
        delivery_id: DeliveryId,
        rerun: Annotated[
            bool,
            Field(description="Start new runs whatever the triggers' policies say."),
        ] = False,
    ) -> CallToolResult:
        async def work(store: RunStore) -> str:
            serving = Serving.of(_with_triggers(store.config), store)
            record = await deliveries.replay(
                serving.store, serving.by_path, serving.config.settings, serving.version,
                delivery_id, rerun=rerun,
            )  # fmt: skip
            return replay_text(record)

        return await run_tool(ctx, work)


def _with_triggers(config: Config) -> Config:
    """The config's file read again, triggers and all: `realm mcp` loads the workflows
    only (its run tools need no webhook secret), and a replay wants the triggers as
    they are now."""
    try:
        return load_config(config.file, with_triggers=True)
    except ConfigError as exc:
        raise RealmError(
            "CONFIG_INVALID",
            f"a replay needs the triggers, which do not load: {exc} (realm mcp needs the "
            "webhook secrets in its environment for this, as realm listen does)",
        ) from None
