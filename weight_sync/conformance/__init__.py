"""Conformance kit: the cases of `weight_sync/PROTOCOL.md`, run against any receiver like an outside client would.

    python -m weight_sync conformance --to HOST:PORT [--token TOKEN] [--case NAME ...] [--include_pending]

Each case is a small function with a name, what it checks (its docstring) and the status it expects; the kit prints
a pass/fail table and exits 1 when a case fails. It speaks only the public protocol: stock protobuf messages over
the gRPC service and hand-written frames on the socket data plane; chunking, checksums and delta payloads are built
here from the written rules, not with the sender's code.

What it needs and what it changes: a receiver nobody else pushes to while the kit runs, whose manifest it reads with
Describe. Positive cases push synthetic values into a few of the smallest tensors (`probe`: the smallest tensor with
at least 4 rows; `big`: the smallest one larger than a chunk) and commit them as the next versions, so run it only
against a receiver whose weights may be overwritten (the kit's session is then the receiver's trainer session until
the real trainer commits again). Everything else it opens (updates, streams, connections) it aborts or closes before
the next case, so the receiver ends idle at a newer version. Cases that wait for one of the receiver's own timeouts
(hello, idle streams) wait at most `max_wait_s`.

A case whose expected status depends on work that has not landed in this repository is `pending` (none today): it is
skipped with the reason unless `include_pending` is set.

Layout: `wire.py` builds values, chunks and frames from the written rules; `streams.py` drives a gRPC Push stream and a
socket connection by hand; `kit.py` is the receiver under test (`Kit`: calls, manifest, limits, cleanup after each
case); `case.py` declares cases; `cases/` holds them by topic, `cases.CASES` in the order they run; `runner.py` runs
them and prints the table.
"""

from weight_sync.conformance.case import Case
from weight_sync.conformance.cases import CASES
from weight_sync.conformance.runner import Result, describe_cases, format_table, run_conformance

__all__ = ["CASES", "Case", "Result", "describe_cases", "format_table", "run_conformance"]
