"""The kit's cases by topic, each module a `CaseGroup`; `CASES` runs them in this order (the last case checks that
the kit left the receiver idle)."""

from __future__ import annotations

from weight_sync.conformance.case import Case
from weight_sync.conformance.cases import (
    abort,
    begin,
    bounds,
    commit,
    delta,
    describe,
    push_chunks,
    push_streams,
    shm_plane,
    socket_plane,
)

CASES: list[Case] = [
    *describe.GROUP.cases,
    *begin.GROUP.cases,
    *push_streams.GROUP.cases,
    *push_chunks.GROUP.cases,
    *commit.GROUP.cases,
    *delta.GROUP.cases,
    *abort.GROUP.cases,
    *socket_plane.GROUP.cases,
    *shm_plane.GROUP.cases,
    *bounds.GROUP.cases,
]
assert len({c.name for c in CASES}) == len(CASES), "two cases share a name"
