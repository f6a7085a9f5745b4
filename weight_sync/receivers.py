"""What a sender knows of its receivers from push to push: their Describe replies (asked again when stale), which of
them refuse a push's shards (another model, or another dtype), and which are unreachable and left out for how long.

    receivers = Receivers(sender.describe)
    receivers.refresh(endpoints)                  # Describe again if stale; an unreachable one rests
    dtypes = receivers.declared_dtypes(endpoints)  # the dtype each tensor goes out in
    receivers.check(local_shards, endpoints)       # who refuses these shards; ValueError when everyone does
    why = receivers.left_out(address)              # not to Begin at this push, and why
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from protos import weight_sync_pb2 as pb
from weight_sync.chunking import LocalShard
from weight_sync.peft import is_peft_name
from weight_sync.spec import itemsize

__all__ = ["FIRST_REST_S", "MAX_REST_S", "Receivers"]

FIRST_REST_S, MAX_REST_S = 5.0, 300.0
"""How long an unreachable receiver is left out of pushes after a failed try, first and at most (doubling between)."""


class Receivers:
    """One sender's view of its receivers (each trainer rank has its own: a receiver one rank leaves out fails its
    coverage check at Commit). ``describe(addresses)`` returns each receiver's ``DescribeReply``, or the error text of
    one that did not answer."""

    def __init__(self, describe: Callable[[list[str]], dict[str, pb.DescribeReply | str]]) -> None:
        self._describe = describe
        self.described: dict[str, pb.DescribeReply] = {}
        """The last Describe reply of each receiver that answered one."""
        self._stale = True  # describe again before the next push (first push, failures, newcomers)
        self._refused: dict[str, str] = {}  # address -> why its manifest does not fit this push's shards
        self._other_model: set[str] = set()  # of those, refused for names or shapes (not for a dtype alone)
        self._resting: dict[str, tuple[float, float, str]] = {}  # unreachable: address -> (retry at, backoff s, why)

    def mark_stale(self) -> None:
        """Describe every receiver again before the next push: one may have restarted (other ports, a fixed model),
        or joined."""
        self._stale = True

    def forget(self, address: str) -> None:
        """Drop what is known of a receiver no longer pushed to."""
        for state in (self.described, self._refused, self._resting):
            state.pop(address, None)
        self._other_model.discard(address)

    def refresh(self, endpoints: Sequence[str]) -> None:
        """Describe the receivers of ``endpoints`` not resting when what is known is stale; those that do not answer
        rest (:meth:`rest`)."""
        if not self._stale:
            return
        now = time.monotonic()
        awake = [a for a in endpoints if not self._is_resting(a, now)]
        for address, reply in self._describe(awake).items():
            if isinstance(reply, str):
                self.rest(address, f"Describe: {reply}")
            else:
                self.described[address] = reply
        self._stale = False

    def declared_dtypes(self, endpoints: Sequence[str]) -> dict[str, str]:
        """Tensor name -> the dtype the receivers' manifests declare for it, after :meth:`refresh`. Receivers of
        another model are left out; where receivers declare different dtypes for one tensor, one push cannot serve
        both: the widest wins, so no receiver gets rounded values, and :meth:`check` refuses the others, saying
        what to change."""
        self.refresh(endpoints)
        dtypes: dict[str, str] = {}
        for address, reply in self.described.items():
            if address in self._other_model:
                continue  # another model's: reported per push
            for spec in reply.manifest:
                held = dtypes.setdefault(spec.name, spec.dtype)
                if held != spec.dtype and itemsize(spec.dtype) > itemsize(held):
                    dtypes[spec.name] = spec.dtype
        return dtypes

    def check(self, shards: Sequence[LocalShard], endpoints: Sequence[str], lora_alpha: float = 0.0) -> None:
        """Note the described receivers whose manifest does not take ``shards``, or that would apply adapters among
        them with another alpha than ``lora_alpha`` (the one they were trained with; 0: not said): :meth:`left_out`
        names them at this push, and at each later one until a new Describe finds them fixed. Raises ``ValueError``
        when every receiver of ``endpoints`` answered and refuses them: the shards are of another model than all of
        them serve, a setup error no later push gets past (while one is unreachable, it may be the one that takes
        them)."""
        self._refused.clear()
        self._other_model.clear()
        adapters = lora_alpha > 0 and any(is_peft_name(local.name) for local in shards)
        for address, reply in self.described.items():
            if adapters and reply.lora_alpha and reply.lora_alpha != lora_alpha:
                self._refused[address] = (
                    f"receiver {address} applies adapters with lora_alpha {reply.lora_alpha:g}, and these were "
                    f"trained with {lora_alpha:g}: restart it with --alpha {lora_alpha:g} (the rl_align vLLM "
                    "plugin: lora.alpha), or set the run's [model.lora] alpha to its"
                )
                self._other_model.add(address)
                continue
            theirs = {s.name: (tuple(s.shape), s.dtype) for s in reply.manifest}
            for local in shards:
                want = theirs.get(local.name)
                if want is not None and want[0] == local.spec.shape and want[1] != local.spec.dtype:
                    self._refused[address] = (
                        f"receiver {address} declares {local.name} as {want[1]}, and this push sends it as "
                        f"{local.spec.dtype} (one push sends a tensor in one dtype, the widest its receivers declare): "
                        f"serve it from a {local.spec.dtype} copy of its checkpoint, or give every receiver one dtype"
                    )
                    break
                if want != (local.spec.shape, local.spec.dtype):
                    held = "has no such tensor" if want is None else f"holds it as {want[0]}" + (
                        f" {want[1]}" if want[1] != local.spec.dtype else "")
                    self._refused[address] = (
                        f"receiver {address} does not accept {local.name} {local.spec.shape} {local.spec.dtype} "
                        f"(it {held}); is it serving the same model (for adapters: the same rank and targets)?"
                    )
                    self._other_model.add(address)
                    break
        now = time.monotonic()
        if all(a in self._refused and not self._is_resting(a, now) for a in endpoints):
            raise ValueError("; ".join(self._refused[a] for a in endpoints))

    def left_out(self, address: str) -> str | None:
        """Why ``address`` gets no Begin at this push (it rests, or refuses the shards), or None."""
        now = time.monotonic()
        if self._is_resting(address, now):
            retry_at, _, why = self._resting[address]
            return f"left out for {retry_at - now:.0f} s more: its last try failed ({why})"
        if address in self._refused:
            return f"Describe: {self._refused[address]}"
        return None

    def rest(self, address: str, why: str) -> None:
        """Leave out an unreachable receiver for a while, doubling the pause at each failed try (up to
        :data:`MAX_REST_S`): each push to it cost its Describe and Begin retries, seconds of every step."""
        backoff = min(2 * self._resting[address][1], MAX_REST_S) if address in self._resting else FIRST_REST_S
        self._resting[address] = (time.monotonic() + backoff, backoff, why)

    def reached(self, address: str) -> None:
        """A push reached ``address``: it rests no more."""
        self._resting.pop(address, None)

    def _is_resting(self, address: str, now: float) -> bool:
        resting = self._resting.get(address)
        return resting is not None and now < resting[0]
