"""The ``realm`` command (the entry point): the root group, with each command group
added from its own module. Every command parses its flags, calls one typed function and
prints its reply; what they share (options, store plumbing, error reporting, the exit
codes) is in gateway/cli/common.py.
"""

from __future__ import annotations

import click

from gateway.cli.deliveries import deliveries
from gateway.cli.listen import listen
from gateway.cli.mcp import mcp
from gateway.cli.recover import recover
from gateway.cli.runs import run
from gateway.cli.send import send
from gateway.cli.triggers import triggers
from gateway.cli.work import work


@click.group()
@click.version_option(package_name="realm-gateway")
def main() -> None:
    """Realm Gateway: verified webhooks become exactly-once workflow runs."""


for command in (run, listen, mcp, triggers, work, deliveries, recover, send):
    main.add_command(command)
