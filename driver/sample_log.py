"""``samples.jsonl``: a few of each step's samples as text, to read what the policy writes as it trains.

One JSON object per line: ``step``, ``group_id``, ``problem_id``, ``answer``, ``reward``, ``reward_terms``,
``finish_reason``, ``num_turns`` (multi-turn episodes), ``policy_version``, ``prompt`` and ``completion`` (decoded
with their special tokens, so a turn's end and a chat template's markup show; a multi-turn completion holds the
observations between the model's turns). The samples are the first of each of the step's first groups: the same
choice every step, so a problem's line can be followed. Decoding reads the tokenizer's ``tokenizer.json`` with the
``tokenizers`` library (the driver does not import transformers for it); a tokenizer without that file logs ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.run_dir import SAMPLES
from driver.metrics import keep_records
from rollout.types import Sample

__all__ = ["SampleLog"]

log = logging.getLogger("rl_align")


class SampleLog:
    """Appends ``per_step`` samples of each step to ``<out_dir>/samples.jsonl`` (see the module docstring)."""

    def __init__(self, out_dir: str | Path, tokenizer_dir: str, per_step: int, append: bool = False) -> None:
        self.path = Path(out_dir) / SAMPLES
        self.per_step = per_step
        self._decoder: Any = _decoder(tokenizer_dir) if per_step else None
        if per_step and not append:
            self.path.write_text("")

    def write(self, step: int, samples: Sequence[Sample]) -> None:
        """Record the first sample of each of the first ``per_step`` groups of ``samples`` as ``step``."""
        if not self.per_step:
            return
        firsts: dict[int, Sample] = {}
        for sample in samples:
            firsts.setdefault(sample.group_id, sample)
            if len(firsts) == self.per_step:
                break
        with self.path.open("a", encoding="utf-8") as f:
            for sample in firsts.values():
                f.write(json.dumps(self._record(step, sample), ensure_ascii=False) + "\n")  # readable in any script

    def drop_from(self, step: int) -> None:
        """Remove the records of ``step`` and later, and a line a killed run cut short: a resumed run generates
        those steps again."""
        if self.path.is_file():
            keep_records(self.path, lambda r: r.get("step", step) < step)

    def _record(self, step: int, sample: Sample) -> dict[str, Any]:
        meta = sample.metadata
        record: dict[str, Any] = {
            "step": step, "group_id": sample.group_id, "problem_id": meta.get("problem_id"),
            "answer": meta.get("answer"), "reward": sample.reward, "reward_terms": dict(sample.reward_terms),
            "finish_reason": sample.finish_reason, "policy_version": sample.policy_version,
        }  # fmt: skip
        if "num_turns" in meta:
            record["num_turns"] = meta["num_turns"]
        prompt, completion = sample.prompt_ids.tolist(), sample.completion_ids.tolist()
        if self._decoder is None:
            return {**record, "prompt_ids": prompt, "completion_ids": completion}
        return {**record, "prompt": self._decoder.decode(prompt, skip_special_tokens=False),
                "completion": self._decoder.decode(completion, skip_special_tokens=False)}  # fmt: skip


def _decoder(tokenizer_dir: str) -> Any:
    """The ``tokenizers.Tokenizer`` of ``tokenizer_dir/tokenizer.json``, or None (ids are logged) with a note."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (a missing or unreadable file, another format: ids are still useful)
        log.info("%s: token ids, not text (no readable %s: %s)", SAMPLES, path, e)
        return None
