"""``realm mcp``: the run and delivery-log tools (gateway/faces/mcp_tools.py) served to
an MCP client over stdio, on the store the options name."""

from __future__ import annotations

import signal
import sys

import click

from gateway.cli.common import EXIT_UNAVAILABLE, load_config_or_exit, server_options
from gateway.link.connection import redis_target
from gateway.link.embedded import ServerNotFound


@click.command("mcp")
@server_options
def mcp(config_path: str, redis_url: str | None, data_dir: str) -> None:
    """Serve the run tools to an MCP client over stdio."""
    # The MCP SDK takes a second or more to import: only this command pays for it.
    from gateway.faces.mcp_tools import serve_stdio

    config = load_config_or_exit(config_path, with_triggers=False)
    # A client may end the server with SIGTERM rather than by closing stdin: leave
    # through the `with` below, so the embedded server is released in order (and
    # stopped if this was its last user) instead of left for the next user to adopt.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with redis_target(redis_url, data_dir) as target:
            click.echo(f"using {target.description}", err=True)  # stdout is the protocol
            serve_stdio(config, target.url)
    except (ServerNotFound, RuntimeError) as exc:
        click.echo(f"error: cannot start the embedded server: {exc}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
