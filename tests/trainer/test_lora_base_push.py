"""A resumed LoRA run's pushes: a receiver that holds an older base than the adapters apply to (a server restarted on
its directory) is pushed the base with them, not the adapters alone. A module of its own: the trainer worker sets up
its own process group, which the one-rank group of ``test_lora_training``'s module fixture would clash with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_lora_training import _configs

from common.net import free_port


def test_a_resumed_trainer_pushes_its_warm_started_base_to_a_receiver_that_lacks_it(tmp_path: Path) -> None:
    """Regression: a resumed LoRA run (its base the warm start's export, at version 3) pushed adapters alone, and a
    server restarted on the original model (back at version 0) merged them into the wrong base, silently."""
    from tools.make_tiny_model import make_tiny_model
    from trainer.models.hf_config import model_config_from_hf
    from trainer.models.hf_io import hf_manifest
    from trainer.worker import TrainerWorker
    from weight_sync.config import WeightSyncConfig
    from weight_sync.peft import adapter_manifest
    from weight_sync.receiver import WeightReceiver
    from weight_sync.sink import StateDictSink, write_policy_version
    from weight_sync.spec import TensorSpec, dtype_name

    base = make_tiny_model(tmp_path / "warm_start_model", seed=5, vocab_size=300, hidden_size=32, num_layers=1,
                           num_heads=2)  # fmt: skip
    write_policy_version(str(base), 3)  # what the warm start's export records
    cfg, dense, algo = _configs(str(tmp_path / "ckpt"), 1)
    model_cfg = model_config_from_hf(str(base)).model_copy(update={"lora": dense.lora})
    specs = [TensorSpec(n, s, dtype_name(d)) for n, s, d in hf_manifest(model_cfg)]
    held = {s.name: torch.zeros(s.shape) for s in [*specs, *adapter_manifest(specs, dense.lora)]}
    receiver = WeightReceiver(StateDictSink(held), WeightSyncConfig())  # restarted on the original model: version 0
    receiver.start()
    worker = TrainerWorker(0, cfg, model_cfg, algo, init_path=str(base),
                           weight_sync=WeightSyncConfig(endpoints=[receiver.address], delta=False))  # fmt: skip
    try:
        worker.setup("127.0.0.1", free_port())
        assert worker.state is not None
        worker.state.policy_version = 5  # as the checkpoint it resumed from
        first = worker.push_weights()
        assert first["behind"] == {receiver.address: 0} and receiver.address in first["push_errors"]
        assert receiver.policy_version == 0
        again = worker.push_weights(endpoints=[receiver.address], with_base=True)
        assert again["push_errors"] == {} and again["commit_errors"] == {} and receiver.policy_version == 5
        name = "model.layers.0.self_attn.q_proj.weight"
        from safetensors.torch import load_file

        assert torch.equal(held[name], load_file(str(base / "model.safetensors"))[name].float())
        worker.state.policy_version = 6  # it holds the base now: adapters alone
        later = worker.push_weights()
        assert later["behind"] == {} and later["push_errors"] == {} and receiver.policy_version == 6
        # A server restarted with another alpha would scale every adapter wrong: the run's alpha travels with them.
        other_alpha = WeightReceiver(_AlphaSink(held, 2 * dense.lora.alpha), WeightSyncConfig())
        other_alpha.start()
        try:
            with pytest.raises(ValueError, match=f"lora_alpha {2 * dense.lora.alpha:g}, and these were trained with "
                               f"{dense.lora.alpha:g}"):  # fmt: skip
                worker.push_weights(endpoints=[other_alpha.address], with_base=True)
            assert other_alpha.policy_version == 0
        finally:
            other_alpha.stop(grace_s=0)
    finally:
        worker.shutdown()
        receiver.stop(grace_s=0)


class _AlphaSink:
    """A state dict that says the LoRA alpha it applies adapters with (as the engines and adapter sinks do)."""

    def __init__(self, held: dict[str, torch.Tensor], alpha: float) -> None:
        from weight_sync.sink import StateDictSink

        self._inner, self._alpha = StateDictSink({n: t.clone() for n, t in held.items()}), alpha
        self.manifest, self.apply, self.committed_version = (
            self._inner.manifest, self._inner.apply, self._inner.committed_version)

    def lora_alpha(self) -> float:
        return self._alpha
