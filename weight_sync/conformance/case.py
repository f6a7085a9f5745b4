"""What a conformance case is, and how a topic module declares its cases (in the order they run)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from weight_sync.conformance.kit import Kit

CaseRun = Callable[[Kit], str]
"""A case's body: runs against the kit and returns the status it observed (raises CaseFailed / CaseSkipped)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case: `run(kit)` returns the status it observed, which must equal `expected`."""

    name: str
    checks: str
    expected: str
    run: CaseRun
    pending: str | None = None
    """Why the expectation depends on work not landed yet; such a case is skipped unless asked for."""


class CaseGroup:
    """The cases of one topic, in the order they are declared."""

    def __init__(self) -> None:
        self.cases: list[Case] = []

    def case(
        self, expected: str, pending: str | None = None, *, name: str | None = None, checks: str | None = None
    ) -> Callable[[CaseRun], CaseRun]:
        """Register a case function; its name is the case name (or `name`), its docstring's first line what it checks
        (or `checks`)."""

        def register(fn: CaseRun) -> CaseRun:
            what = checks or (fn.__doc__ or "").strip().splitlines()[0]
            self.cases.append(Case(name or fn.__name__, what, expected, fn, pending))
            return fn

        return register

    def refusal(self, expected: str, doc: str, checks: str, run: CaseRun) -> None:
        """Register `run` as a case from a one-line `doc`, "name: what it sends"; it checks `checks` with `{}` standing
        for what it sends."""
        name, what = doc.split(": ", 1)
        self.case(expected, name=name, checks=checks.format(what))(run)
