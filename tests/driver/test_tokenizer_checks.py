"""The tokenizer against the model and the task, from its files, before Ray starts (and in ``--check``): ids past the
model's embedding rows, and chat-message prompts with no chat template to render them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from driver.preflight import check_offline
from recipe import load_recipe
from tools.make_tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "qwen3", hidden_size=32, num_layers=1)


def _model(tmp_path: Path, tiny: Path, vocab_size: int | None = None, template: bool = True) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    if vocab_size is not None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    if not template:
        (model / "chat_template.jinja").unlink()
    return model


def _messages_task(tmp_path: Path) -> Path:
    rows = [{"id": f"m{i}", "prompt": [{"role": "system", "content": "Answer with a number."},
                                        {"role": "user", "content": f"What is {i} plus 1?"}], "answer": str(i + 1)}
            for i in range(8)]  # fmt: skip
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _recipe(model: Path, **overrides: object):
    return load_recipe(ROOT / "recipes" / "grpo_tiny.toml", {"model.path": str(model), **overrides})


def test_a_tokenizer_with_more_ids_than_the_models_rows_is_refused(tmp_path, tiny):
    """Tokens added without resizing the embeddings ended the warm start in `IndexError: index out of range`."""
    with pytest.raises(ValueError, match=r"the tokenizer in .* has 410 token ids and the model in .* 300 embedding "
                                         r"rows.*resize_token_embeddings"):
        check_offline(_recipe(_model(tmp_path, tiny, vocab_size=300)))


def test_message_prompts_need_a_chat_template_or_an_explicit_plain_rendering(tmp_path, tiny):
    """A tokenizer without a template joined the messages as plain text, roles dropped, silently."""
    model, task = _model(tmp_path, tiny, template=False), _messages_task(tmp_path)
    jsonl = {"task": {"type": "jsonl", "path": str(task), "num_eval_problems": 2}}
    with pytest.raises(ValueError, match=r"problem '[^']+' \(and any like it\) has a prompt of several chat messages.*"
                                         r"tokenizer in .* has no chat template.*use_chat_template = false"):
        check_offline(_recipe(model, **jsonl))
    check_offline(_recipe(model, **jsonl, **{"rollout.use_chat_template": False}))  # asked for: plain text
    text_task = tmp_path / "text.jsonl"  # one user message each: plain text loses nothing, as before
    text_task.write_text("".join(json.dumps({"prompt": f"What is {i} plus 1?", "answer": str(i + 1)}) + "\n"
                                 for i in range(8)))  # fmt: skip
    check_offline(_recipe(model, **{"task": {"type": "jsonl", "path": str(text_task), "num_eval_problems": 2}}))
    with pytest.raises(ValueError, match="several chat messages"):  # a system prompt would be dropped silently
        check_offline(_recipe(model, **{"task": {"type": "jsonl", "path": str(text_task), "num_eval_problems": 2,
                                                 "system_prompt": "Answer with a number."}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout.use_chat_template = true, and the tokenizer .* no chat template"):
        check_offline(_recipe(model, **{"rollout.use_chat_template": True}))
    check_offline(_recipe(_model(tmp_path / "with", tiny), **jsonl))  # with its template: fine
