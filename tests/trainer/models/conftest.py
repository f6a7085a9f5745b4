"""Fixtures of the model tests: the tiny HF reference models, saved once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.models.tiny_hf import TINY_HF, save_hf_model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Every tiny HF model saved once per test module: name -> (directory, HF model)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, save_hf_model(name, root / name)) for name in TINY_HF}
