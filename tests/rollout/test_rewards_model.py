"""Reward-model term: a tiny local sequence classifier, scored in batches, against a last-token reference forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.rewards import RewardConfig, RewardModelConfig, RewardScorer
from rollout.rewards.reward_model import RewardModelReward
from rollout.tasks import Problem
from tools.tiny_tokenizer import build_tokenizer, save_tokenizer

PROBLEMS = [
    Problem(prompt=[{"role": "user", "content": "What is 2 + 3?"}], answer="5", problem_id="a"),
    Problem(
        prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        answer="",
        problem_id="b",
    ),
    Problem(prompt="plain text prompt", answer="", problem_id="c"),
]
COMPLETIONS = ["5", "Hello there, this is a much longer completion than the others", "ok"]


def _make_reward_model(out: Path, with_template: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    tokenizer = build_tokenizer(vocab_size=300, seed=0)
    if not with_template:
        tokenizer.chat_template = None
    config = Qwen3Config(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen3ForSequenceClassification(config).save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


@pytest.fixture(scope="module")
def chat_rm(tmp_path_factory) -> Path:
    return _make_reward_model(tmp_path_factory.mktemp("rm") / "chat", with_template=True)


@pytest.fixture(scope="module")
def plain_rm(tmp_path_factory) -> Path:
    return _make_reward_model(tmp_path_factory.mktemp("rm") / "plain", with_template=False)


def _reference(path: Path, texts: list[str], add_special_tokens: bool, label: int) -> list[float]:
    """Score each text alone: backbone forward, then the score head on the very last position (no HF pooling)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text, add_special_tokens=add_special_tokens)])
            hidden = model.model(input_ids=ids).last_hidden_state
            out.append(model.score(hidden[:, -1]).float()[0, label].item())
    return out


def _chatml(problem: Problem, completion: str) -> str:
    messages = [{"role": "user", "content": problem.prompt}] if isinstance(problem.prompt, str) else problem.prompt
    turns = [*messages, {"role": "assistant", "content": completion}]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns)


@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_batched_scores_match_unbatched_reference(chat_rm, batch_size):
    scorer = RewardScorer.from_config(
        RewardConfig(terms=[RewardModelConfig(path=str(chat_rm), batch_size=batch_size, label_index=1, weight=0.5)])
    )
    rewards, terms, metrics = scorer.score(COMPLETIONS, PROBLEMS)
    expected = _reference(chat_rm, [_chatml(p, c) for p, c in zip(PROBLEMS, COMPLETIONS)], False, label=1)
    assert terms["reward_model"] == pytest.approx(expected, abs=1e-5)
    assert rewards == pytest.approx([0.5 * e for e in expected], abs=1e-5)
    assert metrics == {"reward/reward_model/num_errors": 0.0, "reward/num_errors": 0.0}


def test_without_template_and_with_pad_token_in_the_text(plain_rm):
    term = RewardModelReward(RewardModelConfig(path=str(plain_rm), batch_size=8))
    # The second completion ends in the pad token: padding must not be confused with it.
    completions = ["5", " ends in pad<|endoftext|>", "a much longer completion to force padding of the others"]
    scores, num_errors = term.score(completions, PROBLEMS, ["s0", "s1", "s2"])
    prompts = ["What is 2 + 3?", "Be brief.\n\nHi", "plain text prompt"]
    texts = [p + c for p, c in zip(prompts, completions)]
    assert num_errors == 0
    assert scores == pytest.approx(_reference(plain_rm, texts, True, label=0), abs=1e-5)


def test_long_inputs_keep_their_leading_special_tokens_and_their_end(chat_rm):
    """Cut from the left alone, an input lost its first token: the BOS of a decoder, the [CLS] an encoder scores."""
    term = RewardModelReward(RewardModelConfig(path=str(chat_rm), max_length=8))
    scores, _ = term.score(["5"], PROBLEMS[:1], ["s0"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_rm)
    ids = tokenizer.encode(_chatml(PROBLEMS[0], "5"), add_special_tokens=False)
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    assert ids[0] in special and ids[1] not in special  # <|im_start|>, then text
    kept_text = tokenizer.decode(ids[:1] + ids[-7:])
    assert scores == pytest.approx(_reference(chat_rm, [kept_text], False, label=0), abs=1e-5)


def test_bad_reward_model_settings(chat_rm, tmp_path):
    with pytest.raises(ValueError, match=r"label_index = 2, and the model in .* has 2 label\(s\)"):
        RewardModelReward(RewardModelConfig(path=str(chat_rm), label_index=2))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardScorer.from_config(RewardConfig(terms=[RewardModelConfig(path=str(tmp_path / "missing"))]))


def test_a_directory_that_is_no_trained_reward_model_is_refused_before_and_at_load(chat_rm, tmp_path):
    """A causal LM's directory loaded as a classifier got a random score head: --check said ok, the run trained on
    noise. A tokenizer past the embedding rows failed in the first rollout with an IndexError naming nothing."""
    import json
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    lm = tmp_path / "lm"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(lm)
    shutil.copy(chat_rm / "tokenizer.json", lm / "tokenizer.json")
    assert "not a sequence classifier" in RewardModelConfig(path=str(lm)).directory_problem()
    config = json.loads((lm / "config.json").read_text())
    (lm / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"]}))
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (chat_rm / name).exists():
            shutil.copy(chat_rm / name, lm / name)
    with pytest.raises(ValueError, match=r"its checkpoint lacks 1 weight\(s\) the classifier needs \(score.weight\)"):
        RewardModelReward(RewardModelConfig(path=str(lm)))
    small = tmp_path / "small"
    shutil.copytree(chat_rm, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    assert "embedding rows" in RewardModelConfig(path=str(small)).directory_problem()
    assert RewardModelConfig(path=str(chat_rm)).directory_problem() is None
