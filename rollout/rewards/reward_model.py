"""Reward from a local HF sequence-classification model, scored in batches with transformers.

Each sample is rendered as a conversation (prompt messages, then the completion as the assistant turn) with the reward
model's own chat template when it has one, else as prompt text followed by the completion; inputs longer than
``max_length`` (at most the model's positions) keep their leading special tokens (a BOS, the ``[CLS]`` an encoder
scores from) and their last tokens. Batches are right-padded, so position ids match an unpadded forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.chat_turns import has_chat_template
from rollout.rewards.config import RewardModelConfig
from rollout.tasks.problem import Problem, chat_messages
from rollout.tokenizer import load_tokenizer, messages_to_text

__all__ = ["RewardModelReward"]


class RewardModelReward:
    """A reward term whose score is one output logit of a sequence classifier at the last token."""

    def __init__(self, config: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self.name = config.term_name
        self.weight = config.weight
        self._config = config
        self._tokenizer = load_tokenizer(config.path)
        problem = config.directory_problem()
        if problem is not None:
            raise ValueError(f"reward term {self.name!r}: {problem}")
        try:
            self._model, loading = AutoModelForSequenceClassification.from_pretrained(
                config.path, local_files_only=True, dtype=getattr(torch, config.dtype), output_loading_info=True
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"reward model {config.path!r}: cannot load it as a sequence classifier "
                f"(AutoModelForSequenceClassification): {e}"
            ) from e
        if loading.get("missing_keys"):  # initialised at random: the scores would be noise
            missing = sorted(loading["missing_keys"])
            raise ValueError(f"reward model {config.path!r}: its checkpoint lacks {len(missing)} weight(s) the "
                             f"classifier needs ({', '.join(missing[:4])}), which would be random: not a trained "
                             "reward model")  # fmt: skip
        # The model's positions, and its tokenizer's limit where it says one (RoBERTa's 514 positions hold 512 tokens).
        limits = [config.max_length, getattr(self._model.config.get_text_config(), "max_position_embeddings", None),
                  getattr(self._tokenizer, "model_max_length", None)]  # fmt: skip
        self._max_length = min(n for n in limits if isinstance(n, int) and 0 < n < 1 << 30)
        added = self._tokenizer.added_tokens_decoder  # a template's markers (<|im_start|>) are special tokens added
        special = {*self._tokenizer.all_special_ids, *(i for i, token in added.items() if token.special)}
        self._is_special = special.__contains__
        self._model.to(config.device).eval()
        self._vocab_size = self._model.get_input_embeddings().num_embeddings

    def score(
        self, completions: Sequence[str], problems: Sequence[Problem], labels: Sequence[str]
    ) -> tuple[list[float], int]:
        ids = [self._encode(c, p) for c, p in zip(completions, problems, strict=True)]
        scores: list[float] = []
        for start in range(0, len(ids), self._config.batch_size):
            scores.extend(self._score_batch(ids[start : start + self._config.batch_size]))
        return scores, 0

    def _encode(self, completion: str, problem: Problem) -> list[int]:
        tokenizer = self._tokenizer
        if has_chat_template(tokenizer):
            conversation = [*chat_messages(problem.prompt), {"role": "assistant", "content": completion}]
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = problem.prompt if isinstance(problem.prompt, str) else messages_to_text(problem.prompt)
            ids = tokenizer.encode(prompt + completion, add_special_tokens=True)
        ids = list(ids)
        if len(ids) <= self._max_length:
            return ids
        lead = next((i for i, t in enumerate(ids) if not self._is_special(t)), len(ids))
        lead = min(lead, self._max_length // 2)  # a long run of special tokens is cut like text
        return ids[:lead] + ids[len(ids) - (self._max_length - lead) :]

    def _score_batch(self, batch: list[list[int]]) -> list[float]:
        import torch

        # HF pools at the last token that is not the pad id; padding with an id absent from the batch keeps that right
        # even when the tokenizer's pad token also occurs in the text (pad == eos is common).
        used = {t for row in batch for t in row}
        pad_id = self._tokenizer.pad_token_id
        if pad_id is None or pad_id in used:
            pad_id = next(t for t in range(self._vocab_size) if t not in used)
        self._model.config.get_text_config().pad_token_id = pad_id
        longest = max(len(row) for row in batch)
        input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, row in enumerate(batch):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        device = self._config.device
        with torch.inference_mode():
            logits = self._model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
        return logits[:, self._config.label_index].float().cpu().tolist()
