"""Running the cases against a receiver, one after another, and reporting them (the pass/fail table, `--list`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grpc

from weight_sync.config import WeightSyncConfig
from weight_sync.conformance.case import Case
from weight_sync.conformance.cases import CASES
from weight_sync.conformance.checks import CaseFailed, CaseSkipped
from weight_sync.conformance.kit import Kit


@dataclasses.dataclass(frozen=True)
class Result:
    """How one case went: the status it expected and got, and PASS, FAIL or SKIP with why (`detail`)."""

    name: str
    expected: str
    got: str
    outcome: str  # PASS, FAIL or SKIP
    detail: str = ""


def run_conformance(
    address: str,
    config: WeightSyncConfig | None = None,
    *,
    names: Sequence[str] = (),
    include_pending: bool = False,
    timeout_s: float = 10.0,
    probe: str | None = None,
    max_wait_s: float = 60.0,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run the cases (all, or those in `names`) against the receiver at `address`, one after another.

    Raises grpc.RpcError when the receiver cannot be described at all, ValueError for an unknown case or tensor name.
    `probe`: the tensor the cases push (default: the smallest with 4+ rows). Each call waits at most `timeout_s`; a
    case waiting for one of the receiver's own timeouts (hello, idle stream) at most `max_wait_s`.
    """
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; `conformance --list` names them")
    kit = Kit(address, config or WeightSyncConfig(), timeout_s, probe, max_wait_s)
    results = []
    for c in CASES:
        if names and c.name not in names:
            continue
        result = _run_case(kit, c, include_pending)
        results.append(result)
        if on_result is not None:
            on_result(result)
    kit.channel.close()
    return results


def _run_case(kit: Kit, c: Case, include_pending: bool) -> Result:
    if c.pending and not include_pending:
        return Result(c.name, c.expected, "-", "SKIP", f"pending: {c.pending}")
    try:
        got = c.run(kit)
    except CaseSkipped as e:
        return Result(c.name, c.expected, "-", "SKIP", str(e))
    except CaseFailed as e:
        return Result(c.name, c.expected, "-", "FAIL", str(e))
    except grpc.RpcError as e:
        return Result(c.name, c.expected, e.code().name, "FAIL", f"unexpected refusal: {e.details()}")
    except Exception as e:  # a case must report, never stop the kit
        return Result(c.name, c.expected, "-", "FAIL", f"{type(e).__name__}: {e}")
    finally:
        kit.cleanup()
    passed = got == c.expected
    return Result(c.name, c.expected, got, "PASS" if passed else "FAIL", "" if passed else c.checks)


def format_table(results: Sequence[Result]) -> str:
    """The results as a fixed-width table, then a summary line."""
    width = max([len(r.name) for r in results] + [4])
    lines = [f"{'case':<{width}}  {'expected':<19}  {'got':<19}  result"]
    for r in results:
        line = f"{r.name:<{width}}  {r.expected:<19}  {r.got:<19}  {r.outcome}"
        lines.append(f"{line}  {r.detail}" if r.detail else line)
    counts = {o: sum(r.outcome == o for r in results) for o in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)


def describe_cases() -> str:
    """Every case with its expected status and what it checks (`conformance --list`)."""
    width = max(len(c.name) for c in CASES)
    return "\n".join(
        f"{c.name:<{width}}  {c.expected:<19}  {c.checks}" + (f"  [pending: {c.pending}]" if c.pending else "")
        for c in CASES
    )
