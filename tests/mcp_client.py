"""`realm mcp` (``python -m gateway mcp``) as a subprocess, driven over stdio by the
``mcp`` SDK's own client: the session the MCP tests open (tests/test_mcp.py,
test_mcp_deliveries.py, test_cluster_admin.py)."""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

ROOT = Path(__file__).resolve().parents[1]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


class Tools:
    """A connected client session; ``call`` returns the reply text and the error flag."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session

    async def call(self, name: str, **arguments: Any) -> tuple[str, bool]:
        result = await self.session.call_tool(name, arguments)
        assert isinstance(result, CallToolResult)
        assert len(result.content) == 1
        block = result.content[0]
        assert isinstance(block, TextContent)
        assert "Traceback" not in block.text
        return block.text, bool(result.is_error)

    async def ok(self, name: str, **arguments: Any) -> str:
        text, is_error = await self.call(name, **arguments)
        assert not is_error, text
        return text

    async def refused(self, name: str, **arguments: Any) -> str:
        text, is_error = await self.call(name, **arguments)
        assert is_error, text
        assert text.startswith("status: error\n"), text
        return text

    async def start(self, **arguments: Any) -> str:
        """Start (or match) a run; its id."""
        text = await self.ok("start_run", **arguments)
        found = re.search(rf"^run_id: ({UUID})$", text, re.M)
        assert found, text
        return found.group(1)


@asynccontextmanager
async def mcp_session(
    config: Path, redis_url: str, env: dict[str, str] | None = None
) -> AsyncIterator[Tools]:
    """A session of a fresh `realm mcp` process on ``config`` and ``redis_url``; its
    environment is the SDK's safe default plus ``env`` (the webhook secrets a replay
    needs, say)."""
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "gateway", "mcp", "--config", str(config), "--redis-url", redis_url],
        cwd=ROOT,
        env=env,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield Tools(session)
