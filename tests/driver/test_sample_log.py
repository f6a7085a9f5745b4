"""``samples.jsonl``: each step's first samples as text, decoded with their special tokens; a resume drops the steps it
generates again; a tokenizer without ``tokenizer.json`` logs ids."""

from __future__ import annotations

import json

import numpy as np

from driver.sample_log import SampleLog
from rollout.types import Sample
from tools.tiny_tokenizer import build_tokenizer, save_tokenizer


def _sample(tokenizer, group_id: int, prompt: str, completion: str, reward: float) -> Sample:
    return Sample(
        prompt_ids=np.asarray(tokenizer.encode(prompt, add_special_tokens=False), np.int64),
        completion_ids=np.asarray(tokenizer.encode(completion, add_special_tokens=False), np.int64),
        rollout_logprobs=np.zeros(len(tokenizer.encode(completion, add_special_tokens=False)), np.float32),
        reward=reward, group_id=group_id, policy_version=3, reward_terms={"exact_match": reward},
        metadata={"problem_id": f"p{group_id}", "answer": "7"},
    )  # fmt: skip


def test_the_first_sample_of_each_first_group_is_logged_as_text(tmp_path):
    tokenizer = build_tokenizer()
    save_tokenizer(tokenizer, tmp_path / "tok")
    samples = [_sample(tokenizer, g, f"<|im_start|>user\nwhat is {g} + 4?<|im_end|>\n", f"{g + 4}<|im_end|>", 1.0)
               for g in (5, 5, 6, 7)]  # fmt: skip
    (tmp_path / "out").mkdir()
    log = SampleLog(tmp_path / "out", str(tmp_path / "tok"), per_step=2)
    log.write(0, samples)
    log.write(1, samples)
    records = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group_id"]) for r in records] == [(0, 5), (0, 6), (1, 5), (1, 6)]
    first = records[0]
    assert first["completion"] == "9<|im_end|>" and first["prompt"].startswith("<|im_start|>user\nwhat is 5 + 4?")
    assert first["problem_id"] == "p5" and first["reward_terms"] == {"exact_match": 1.0}
    assert first["policy_version"] == 3 and first["finish_reason"] == "stop"
    with log.path.open("a") as f:
        f.write('{"step": 2, "group_id": 5, "prom')  # a line a killed run cut short
    log.drop_from(1)  # a run resumed at step 1 generates it again
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [0, 0]
    resumed = SampleLog(tmp_path / "out", str(tmp_path / "tok"), per_step=2, append=True)
    resumed.write(1, samples[2:])
    assert [json.loads(line)["group_id"] for line in log.path.read_text().splitlines()] == [5, 6, 6, 7]


def test_without_tokenizer_json_ids_are_logged_and_zero_logs_nothing(tmp_path):
    tokenizer = build_tokenizer()
    (tmp_path / "out").mkdir()
    log = SampleLog(tmp_path / "out", str(tmp_path / "no_tokenizer"), per_step=1)
    log.write(0, [_sample(tokenizer, 0, "a", "b", 0.0)])
    [record] = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert record["completion_ids"] == tokenizer.encode("b", add_special_tokens=False) and "completion" not in record
    unicode = _sample(tokenizer, 1, "a", "b", 0.0)
    unicode.metadata["answer"] = "café 答え"
    log.write(1, [unicode])
    assert '"answer": "café 答え"' in log.path.read_text(encoding="utf-8")  # readable, not \u00e9
    log.drop_from(2)  # rewritten as UTF-8 too
    assert json.loads(log.path.read_text(encoding="utf-8").splitlines()[-1])["answer"] == "café 答え"
    off = SampleLog(tmp_path / "off", str(tmp_path / "no_tokenizer"), per_step=0)
    off.write(0, [_sample(tokenizer, 0, "a", "b", 0.0)])
    assert not (tmp_path / "off" / "samples.jsonl").exists()
