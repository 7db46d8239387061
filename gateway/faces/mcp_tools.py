"""The MCP server (``realm mcp``): the run store over stdio, with the run tools
(``gateway.faces.mcp_runs``), the delivery-log tools (``gateway.faces.mcp_deliveries``)
and the instructions a client reads first.

Built on the official ``mcp`` SDK (2.x, ``MCPServer``). The tools' arguments
mirror the HTTP API, and their replies are Realm's text replies (``status: ok`` or
``status: error`` and a code, then the lines), exactly as the CLI prints them, so a
run started through MCP reads like Realm's documentation. A refusal is a reply too
(``status: error`` and its code, with the result marked as an error), never an
exception or a traceback; an argument that fails its schema reads the same way.

Only the protocol goes to stdout; logs go to stderr.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from pydantic import ValidationError

from gateway.faces.mcp_calls import error_result
from gateway.faces.mcp_deliveries import add_delivery_tools
from gateway.faces.mcp_runs import add_run_tools
from gateway.link.connection import redis_client
from gateway.model.config import Config
from gateway.model.errors import RealmError
from gateway.store.runstore import RunStore

__all__ = ["INSTRUCTIONS", "RealmMCPServer", "StoreFactory", "build_server", "serve_stdio"]

StoreFactory = Callable[[], AbstractAsyncContextManager[RunStore]]
"""Opens the store for the server's lifetime and closes it after (see ``serve_stdio``)."""

INSTRUCTIONS = """\
Realm starts workflow runs exactly once. Give start_run an idempotency_key that
names the piece of work (an order number, an event id): a repeat with the same key
starts nothing and returns the run that already exists (deduped: true), with the
step that is ready next. Every reply starts with 'status: ok' or 'status: error'
followed by a code such as STATE_RUN_ALREADY_ACTIVE.

To be a runner: claim_step takes the next ready step of a workflow with a lease;
do the step, then report it with complete_step (with its output) or fail_run,
passing the lease. A result that comes back after the run was cancelled or moved
on is discarded (STATE_RUN_NOT_LIVE, STATE_STEP_NOT_CURRENT): do not redo it.

The delivery log: list_deliveries and get_delivery show which webhooks arrived and
what each trigger made of them (why one was ignored or refused); after fixing a
trigger in triggers.yaml, replay_delivery sends a stored delivery through again."""


class RealmMCPServer(MCPServer[RunStore]):
    """``MCPServer`` whose argument-validation refusals read like every other reply:
    ``status: error`` and ``VALIDATION_PARAMS`` naming the fields, not pydantic's text."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(exc, UnexpectedToolError) or not isinstance(cause, ValidationError):
                raise
            problems = "; ".join(
                f"{'.'.join(str(part) for part in err['loc']) or 'arguments'}: {err['msg']}"
                for err in cause.errors()
            )
            return error_result(RealmError("VALIDATION_PARAMS", f"{name}: {problems}"))


def build_server(store_factory: StoreFactory) -> RealmMCPServer:
    """The MCP server with Realm's tools: eight for runs, three for the delivery log.

    ``store_factory()`` is entered once, in the server's lifespan, and its
    ``RunStore`` serves every tool call until the session ends.
    """

    @asynccontextmanager
    async def lifespan(_server: MCPServer[RunStore]) -> AsyncIterator[RunStore]:
        async with store_factory() as store:
            yield store

    server = RealmMCPServer(
        "realm",
        title="Realm Gateway",
        instructions=INSTRUCTIONS,
        lifespan=lifespan,
        log_level="WARNING",
    )

    add_run_tools(server)
    add_delivery_tools(server)
    return server


def serve_stdio(config: Config, redis_url: str) -> None:
    """Serve the MCP tools over stdin/stdout until stdin closes (blocking).

    One Redis client and one ``RunStore`` serve the whole session; they are
    opened in the server's lifespan and closed when it ends.
    """

    @asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        client = redis_client(redis_url, config.settings.redis_timeout)
        try:
            yield RunStore(client, config)
        finally:
            await client.aclose()

    build_server(open_store).run("stdio")
