"""How an MCP tool's work becomes its reply: the work runs on the session's store, and
every outcome is a text reply, a refusal too (``status: error`` and its code, with
the result marked as an error), never an exception or a traceback. Also the text of
one page of a list, which the run and delivery-log tools share.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from mcp.server.mcpserver import Context
from mcp.types import CallToolResult, TextContent

from gateway.ingest import replies
from gateway.model.errors import RealmError, StoreUnavailable
from gateway.store.runstore import RunStore

__all__ = ["error_result", "page_text", "run_tool"]

log = logging.getLogger("realm.mcp")


async def run_tool(
    ctx: Context, work: Callable[[RunStore], Awaitable[str]], *, batch_id: str | None = None
) -> CallToolResult:
    """Run one tool's work on the session's store; every outcome becomes a text reply
    (a batch whose outcome is unknown names its ``batch_id``, for the retry)."""
    try:
        store: RunStore = ctx.request_context.lifespan_context
        return CallToolResult(content=[TextContent(type="text", text=await work(store))])
    except StoreUnavailable as exc:
        return error_result(exc, batch_id=batch_id)
    except RealmError as exc:
        return error_result(exc)
    except Exception:
        # The details (and the traceback) go to the log on stderr only: an
        # exception's text can hold things the caller should not see.
        log.exception("MCP tool failed unexpectedly")
        return error_result(RealmError("INTERNAL", "unexpected server error; see the server's log"))


def error_result(error: RealmError, *, batch_id: str | None = None) -> CallToolResult:
    """A refusal as a reply: its text, with the result marked as an error."""
    text = replies.error_text(error, batch_id=batch_id)
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def page_text(lines: list[str], next_cursor: str | None, *, empty: str) -> str:
    """One page of a list: its lines (``empty`` alone when there are none), then
    ``cursor: ...`` when there may be more, to pass back for the next page."""
    if not lines:
        lines = [empty]
    if next_cursor is not None:
        lines = [*lines, f"cursor: {next_cursor}"]
    return "\n".join(lines)
