"""A minimal runner process for tests/test_runner_proofs.py and bench/runner_bench.py.

It drives the store's runner API directly (take_steps → handler effect →
complete_step; docs: /work/notes/RUNNERS_SPEC.md), with ``--concurrency`` tasks in
one process, and records what it did in an append-only file of its own (one
``O_APPEND`` write per line, so a ``kill -9`` leaves whole lines only):

    begin  <run> <step> <attempt> <taken server ms> <wall time>   handler started
    effect <run> <step> <attempt> <previous step's output step or ->   the side effect
    done   <run> <step> <attempt> <phase>                         complete_step accepted it
    discarded <run> <step> <attempt> <code>                       complete_step refused it

The effect line is written BEFORE complete_step, as a real side effect would be:
a runner killed between the two leaves an effect without a ``done``.

``--runner`` runs the same handler under the product's ``Runner`` instead of this
file's loop (outcome lines from its ``on_outcome``).

``--hold STEP`` makes the handler of STEP wait, after its ``begin`` line, until the
file ``--release`` exists (or forever, until the test kills the process): the test
decides when the middle of a step ends. A complete_step that finds Redis away
(StoreUnavailable) is sent again with the same operation id until it is answered,
so a lost reply is never recorded twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.link.connection import redis_client  # noqa: E402
from gateway.loading import load_config  # noqa: E402
from gateway.model.errors import RealmError, StoreUnavailable  # noqa: E402
from gateway.store.runstore import RunStore  # noqa: E402

IDLE_POLL_S = 0.02  # take_steps does not block: the pause between two empty takes
Handler = Callable[[Any], Awaitable[dict]]  # a taken step -> its output


class Log:
    """One append-only file; each line is one write(2)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, *fields: object) -> None:
        os.write(self.fd, (" ".join(str(f) for f in fields) + "\n").encode())


async def complete(store: RunStore, taken, output: dict, deadline: float) -> tuple[str, str]:
    """complete_step with one operation id, sent again while Redis is away."""
    op_id = str(uuid.uuid4())
    while True:
        try:
            result = await store.complete_step(
                taken.run_id, taken.step, lease=taken.lease, output=output,
                entry_id=taken.entry_id, op_id=op_id,
            )  # fmt: skip
            return "done", result.phase
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        except RealmError as exc:
            return "discarded", exc.code


def step_effect(args: argparse.Namespace, log: Log) -> Handler:
    """The handler both ways of running share: a ``begin`` line, the wait for --release
    if the step is --hold's, an ``effect`` line; its output names the step and attempt."""
    release = Path(args.release) if args.release else None

    async def effect(taken: Any) -> dict:
        log.line("begin", taken.run_id, taken.step, taken.attempt,
                 taken.lease_until_ms - args.lease_ms, f"{time.time():.6f}")  # fmt: skip
        if taken.step == args.hold:
            while release is None or not release.exists():
                await asyncio.sleep(0.01)
        prev = taken.output.get("step", "?") if isinstance(taken.output, dict) else "-"
        log.line("effect", taken.run_id, taken.step, taken.attempt, prev)
        return {"step": taken.step, "attempt": taken.attempt}

    return effect


async def work(args: argparse.Namespace, stop: asyncio.Event) -> None:
    config = load_config(Path(args.config), with_triggers=False)
    store = RunStore(redis_client(args.redis_url, 2.0), config, timeout=2.0)
    log = Log(Path(args.log))
    effect = step_effect(args, log)
    if args.runner:
        await with_runner(args, store, stop, log, effect)
        return
    deadline = time.monotonic() + args.max_seconds

    async def loop() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                steps = await store.take_steps(
                    args.workflow, args.name, count=1, lease_ms=args.lease_ms
                )
            except StoreUnavailable:
                steps = []
            if not steps:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            for taken in steps:
                output = await effect(taken)
                outcome, detail = await complete(store, taken, output, deadline)
                log.line(outcome, taken.run_id, taken.step, taken.attempt, detail)

    await asyncio.gather(*(loop() for _ in range(args.concurrency)))


async def with_runner(
    args: argparse.Namespace, store: RunStore, stop: asyncio.Event, log: Log, effect: Handler
) -> None:
    """The same handler under the product's in-process Runner (gateway/runners/runner.py): it
    takes, extends the lease while the handler runs, and records the result; the
    outcome lines come from its on_outcome (``done ... ok``, ``discarded ... <code>``)."""
    from gateway.runners.runner import Runner, StepOutcome

    def outcome(o: StepOutcome) -> None:
        kind = {"ok": "done", "discarded": "discarded"}.get(o.result, o.result)
        log.line(kind, o.run_id, o.step, o.attempt, o.error or o.result)

    steps = store.config.workflow(args.workflow).steps
    runner = Runner(store, args.workflow, dict.fromkeys(steps, effect),
                    concurrency=args.concurrency, runner_id=args.name,
                    lease=args.lease_ms / 1000, on_outcome=outcome)  # fmt: skip
    task = asyncio.create_task(runner.run())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), args.max_seconds)
    runner.stop()
    await task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--workflow", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--lease-ms", type=int, default=30_000)
    parser.add_argument("--hold", default="")
    parser.add_argument("--release", default="")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--runner", action="store_true", help="use gateway.runners.runner.Runner")
    args = parser.parse_args()

    async def run() -> None:
        stop = asyncio.Event()
        # SIGTERM: stop taking; the steps in hand finish.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await work(args, stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
