"""One policy update from a rollout batch (any algorithm of ``trainer.rl.algorithms``), and one supervised step.

The RL step on each rank, with every rank given the same full batch:

1. split the batch into ``num_minibatches`` mini-batches (one optimizer step each) and pack each into this rank's
   micro-batches (``trainer.packing``: balanced across ranks, equal micro-batch counts everywhere);
2. without gradients: old log-probs (only when a batch is used for more than one optimizer step, or LoRA dropout is
   on; otherwise the trainer's own detached log-probs are the old ones, so the first ratio is exactly 1), reference
   log-probs (KL on), critic values (algorithms with a critic);
3. advantages: ``state.algorithm.compute_advantages`` (GRPO/RLOO from the group rewards, PPO's GAE with global
   whitening; KL folded into the reward if configured);
4. for each epoch and mini-batch: forward -> log-probs through the model's output head -> the algorithm's policy loss
   (and value loss for its critic) -> backward per micro-batch; the loss is divided by the *global* token/sequence
   counts of the mini-batch and FSDP sums gradients over ranks, so N ranks compute exactly the 1-rank update; then
   grad clipping, optimizer and LR step.

Returns one flat dict of floats per step, identical on every rank (``trainer.metrics``).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rollout.types import RolloutBatch, Sample, episode_members
from trainer.devices import (
    compiled_graphs,
    cut_graph,
    data_parallel_devices,
    has_foreach_kernels,
    mesh_device_type,
    needs_static_shapes,
    shard_rows,
)
from trainer.host_memory import RELEASE_MIN_FREE_BYTES, release_freed_memory
from trainer.metrics import Metrics, MetricsAccumulator, PhaseClock
from trainer.models.lora import adapters_disabled
from trainer.models.registry import ATTENTION_BLOCKS
from trainer.models.transformer import Transformer
from trainer.packing import MicroBatch, plan_micro_batches, split_minibatches
from trainer.parallelize import sync_tensor_parallel_partial_grads
from trainer.rl.advantages import whitening_moments
from trainer.rl.algorithms import AdvantageInputs
from trainer.rl.kl import kl_estimate
from trainer.rl.router_aux import add_router_aux_loss, count_router_tokens, moe_aux_coef
from trainer.rl.sft import sft_loss
from trainer.rl.value_loss import explained_variance
from trainer.state import TrainState

__all__ = ["forward_logprobs", "plan_rank_micro_batches", "rl_step", "sft_step", "shares_prompts"]

log = logging.getLogger(__name__)


def forward_logprobs(model: Transformer, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [S, C], entropy [S, C], hidden states [N, D]) of the micro-batch's completion tokens (N: its
    ``loss_positions``), under the distribution each sample was drawn from: ``log_softmax(logits / temperature)``
    (``Sample.temperature``).

    The last block's output projection and feed-forward and the output head run only at the positions that predict a
    completion token (``Transformer.forward(output_positions=...)``): prompt positions never enter the loss, and the
    head (``6 x vocab x dim`` FLOPs per token) would otherwise cost as much as a few blocks.
    """
    positions = mb.loss_positions
    hidden = model(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids, output_positions=positions,
                   prefix_ids=mb.prefix_ids)  # fmt: skip
    head_input = hidden
    if mb.token_temperatures is not None:
        # The head is linear without bias, so logits / T == head(hidden / T): every head (chunked, fused kernel)
        # then yields the tempered log-probs and entropy, with the gradient of the tempered distribution.
        head_input = (hidden.float() / mb.token_temperatures[:, None]).to(hidden.dtype)
    logprobs, entropy = model.token_logprobs(head_input, mb.loss_targets)
    return mb.scatter(logprobs), mb.scatter(entropy), hidden


def plan_rank_micro_batches(state: TrainState, samples: Sequence[Sample], indices: Sequence[int]) -> list[MicroBatch]:
    """This rank's packed micro-batches of ``samples[indices]`` on the state's device, as the steps use them.

    The row cap is ``cfg.pack_row_tokens`` when set; otherwise the whole micro-batch budget when the attention block
    is segment-local (long rows then cost nothing extra and need no padding), else the packer's default. Samples of
    one prompt share it (:func:`shares_prompts`). On a device that compiles per shape, shapes are static
    (``trainer.packing``) and attention is masked (``trainer.models.attention``), so rows stay short there.
    """
    cfg = state.cfg
    static = needs_static_shapes(state.device)
    row_tokens = cfg.pack_row_tokens
    if row_tokens is None and ATTENTION_BLOCKS.is_segment_local(state.model_cfg.attention) and not static:
        row_tokens = cfg.micro_batch_tokens
    mbs = plan_micro_batches(
        samples, indices, state.dp_rank, state.dp_size, cfg.micro_batch_tokens, row_tokens=row_tokens,
        share_prompts=shares_prompts(state), static_shapes=static, min_rows=data_parallel_devices(state.device),
    )  # fmt: skip
    on_device = [mb.to(state.device) for mb in mbs]
    for mb in on_device:  # under SPMD: rows split over the devices (data parallel)
        shard_rows([mb.tokens, mb.positions, mb.segment_ids] + ([] if mb.prefix_ids is None else [mb.prefix_ids]))
    return on_device


def shares_prompts(state: TrainState) -> bool:
    """Whether the trainer packs a prompt once for all its samples (``trainer.packing``): ``trainer.share_prompts``,
    where the attention block takes shared prefixes and the model is dense (an MoE model's router load-balancing term
    counts every sample's prompt tokens, and its token mask is derived from whole-sequence positions)."""
    return (
        state.cfg.share_prompts
        and ATTENTION_BLOCKS.takes_shared_prefix(state.model_cfg.attention)
        and state.model_cfg.moe is None
    )


def _all_reduce_sum(state: TrainState, x: torch.Tensor) -> torch.Tensor:
    """Sum over the data-parallel ranks (tensor-parallel peers hold the same samples)."""
    if state.dp_size > 1:
        dist.all_reduce(x, group=state.dp_group)
    return x


def _advantage_moments(state: TrainState, plans: list[list[MicroBatch]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages over every rank's completion tokens that carry loss, as device tensors (read at the step's
    end, :func:`_advantage_metrics`, not here between two passes): ``whitening_moments``' ``[count, sum, sum of
    squares]`` and ``[max, -min]``. Every rank calls it (collectives)."""
    moments = torch.zeros(3, dtype=torch.float64, device=state.device)
    extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=state.device)
    for mb in (mb for mbs in plans for mb in mbs):
        if mb.loss_mask.numel() == 0:  # a micro-batch without completion tokens
            continue
        mask = mb.loss_mask > 0
        moments += whitening_moments(mb.advantages, mask)
        values = mb.advantages.double()  # masked, not indexed: no data-dependent shapes (XLA)
        top = torch.where(mask, values, -math.inf).max()
        extremes = torch.maximum(extremes, torch.stack([top, torch.where(mask, -values, -math.inf).max()]))
    _all_reduce_sum(state, moments)
    if state.dp_size > 1:
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=state.dp_group)
    return moments, extremes


def _advantage_metrics(moments: torch.Tensor, extremes: torch.Tensor) -> dict[str, float]:
    """``advantage_mean``, ``_std`` (population), ``_min`` and ``_max`` from :func:`_advantage_moments`; nothing
    when no token carried loss."""
    count, total, squares = moments.tolist()
    if count == 0:
        return {}
    mean = total / count
    top, neg_bottom = extremes.tolist()
    return {"advantage_mean": mean, "advantage_std": math.sqrt(max(0.0, squares / count - mean * mean)),
            "advantage_min": -neg_bottom, "advantage_max": top}  # fmt: skip


def _trained_indices(state: TrainState, samples: Sequence[Sample]) -> list[int]:
    """The samples that carry loss: all, or with ``overlong_filter`` those not cut at ``max_tokens``. The others
    still count in their group's advantage statistics (``compute_advantages`` sees the whole batch)."""
    if not state.algorithm.config.overlong_filter:
        return list(range(len(samples)))
    return [i for i, s in enumerate(samples) if s.finish_reason != "length"]


def _minibatches(state: TrainState, samples: Sequence[Sample], trained: list[int], epoch: int) -> list[list[int]]:
    """``trainer.num_minibatches`` mini-batches of ``trained`` (fewer when fewer episodes are left), the same on every
    rank: contiguous in epoch 0, then reshuffled every epoch from the trainer seed, the step and the epoch.

    The unit is the episode: an agent episode that gave several samples stays in one mini-batch, whose loss
    normalisers (:func:`_mini_counts`) count it once with all of its tokens.
    """
    if not trained:
        return []
    episodes = episode_members([samples[i].group_id for i in trained], [samples[i].episode for i in trained])
    num = min(state.cfg.num_minibatches, len(episodes))
    # Overlong filtering, dynamic sampling or dropped episodes shrank the batch.
    if num < state.cfg.num_minibatches and epoch == 0:
        log.warning("step %d: %d episode(s) to train on, fewer than trainer.num_minibatches = %d: %d mini-batch(es)",
                    state.step, len(episodes), state.cfg.num_minibatches, num)  # fmt: skip
    seed = None if epoch == 0 else int(np.random.SeedSequence([state.cfg.seed, state.step, epoch]).generate_state(1)[0])
    parts = split_minibatches(len(episodes), num, seed=seed)
    return [sorted(trained[j] for e in part for j in episodes[e]) for part in parts]


def _reshuffled(
    state: TrainState, samples: Sequence[Sample], trained: list[int], plans: list[list[MicroBatch]], epoch: int
) -> tuple[list[list[int]], list[list[MicroBatch]]]:
    """New mini-batches for ``epoch`` and their micro-batches, carrying over each sample's per-token tensors (the
    advantages and ``extra``: old / reference log-probs, values, returns) from ``plans``."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for mbs in plans:
        for mb in mbs:
            tensors = {"advantages": mb.advantages, **mb.extra}
            for row, i in enumerate(mb.sample_indices):
                n = len(samples[i].completion_ids)
                rows[i] = {name: t[row, :n] for name, t in tensors.items()}
    minis = _minibatches(state, samples, trained, epoch)
    new_plans = [plan_rank_micro_batches(state, samples, idx) for idx in minis]
    first = next(iter(rows.values()))  # every sample carries the same tensors
    for mbs in new_plans:
        for mb in mbs:  # filler micro-batches (no sample) get empty tensors of the same names
            for name, like in first.items():
                full = torch.zeros(mb.loss_mask.shape, dtype=like.dtype, device=state.device)
                for row, i in enumerate(mb.sample_indices):
                    full[row, : len(samples[i].completion_ids)] = rows[i][name]
                if name == "advantages":
                    mb.advantages = full
                else:
                    mb.extra[name] = full
    return minis, new_plans


def _mini_counts(samples: Sequence[Sample], indices: Sequence[int]) -> tuple[float, float]:
    """Global (model-generated completion tokens, episodes with any) of a mini-batch: the loss normalisers. An agent
    episode that gave several samples counts once (``MicroBatch.sequence_tokens`` carries its token count)."""
    members = episode_members([samples[i].group_id for i in indices], [samples[i].episode for i in indices])
    tokens = [sum(samples[indices[j]].num_model_tokens for j in episode) for episode in members]
    return float(sum(tokens)), float(sum(1 for n in tokens if n > 0))


def _critic_values(state: TrainState, mb: MicroBatch) -> torch.Tensor:
    """The critic's values ``[N]`` at the positions that predict completion tokens (as :func:`forward_logprobs`)."""
    assert state.critic is not None
    positions = mb.loss_positions
    return state.critic(mb.tokens, positions=mb.positions, segment_ids=mb.segment_ids, output_positions=positions,
                        prefix_ids=mb.prefix_ids)  # fmt: skip


def _reference_logprobs(state: TrainState, mb: MicroBatch) -> torch.Tensor:
    """Log-probs of the KL reference: its own model, or with LoRA the policy's base (adapters off)."""
    if state.reference is not None:
        return forward_logprobs(state.reference, mb)[0]
    with adapters_disabled(state.policy):
        return forward_logprobs(state.policy, mb)[0]


@torch.no_grad()
def _no_grad_pass(state: TrainState, plans: list[list[MicroBatch]], need_old: bool) -> None:
    """Fill ``extra['old_logprobs' | 'ref_logprobs' | 'values']`` of every micro-batch (no gradients)."""
    for mbs in plans:
        for mb in mbs:
            if need_old:
                mb.extra["old_logprobs"] = forward_logprobs(state.policy, mb)[0]
            if state.algorithm.needs_reference:
                mb.extra["ref_logprobs"] = _reference_logprobs(state, mb)
            if state.critic is not None:
                mb.extra["values"] = mb.scatter(_critic_values(state, mb))
            cut_graph(state.device)


def _kl_for_reward(state: TrainState, mb: MicroBatch) -> torch.Tensor:
    """Per-token KL estimate of the policy the update starts from (the sampling policy in sync mode) to the reference,
    for folding into the reward."""
    old = mb.extra.get("old_logprobs")
    if old is None:
        old = forward_logprobs(state.policy, mb)[0].detach()
        mb.extra["old_logprobs"] = old
    return kl_estimate(old, mb.extra["ref_logprobs"], state.algorithm.config.kl.estimator) * mb.loss_mask


@torch.no_grad()
def _compute_advantages(
    state: TrainState, samples: Sequence[Sample], trained: list[int], plans: list[list[MicroBatch]]
) -> None:
    """Fill ``mb.advantages`` (and ``extra['returns']`` for a critic) of every micro-batch by the algorithm. With the
    KL penalty in the reward of a group-relative algorithm, the samples that carry no loss (``trained`` leaves them
    out) are packed too, for their penalty: their group's statistics count them with their penalised reward."""
    untrained: list[MicroBatch] = []
    config = state.algorithm.config  # group statistics are what count them: PPO's per-sample GAE does not
    if len(trained) < len(samples) and config.kl.in_reward and config.group_relative:
        kept = set(trained)
        untrained = plan_rank_micro_batches(state, samples, [i for i in range(len(samples)) if i not in kept])
        for mb in untrained:
            mb.extra["ref_logprobs"] = _reference_logprobs(state, mb)
            cut_graph(state.device)
    state.algorithm.compute_advantages(AdvantageInputs(
        samples=samples, micro_batches=[mb for mbs in plans for mb in mbs],
        token_kl=lambda mb: _kl_for_reward(state, mb), all_reduce_sum=lambda x: _all_reduce_sum(state, x),
        device=state.device, untrained=untrained,
    ))  # fmt: skip


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by device mesh: foreach kernels refuse DTensors of different meshes in one call (FSDP x TP:
    the root unit lives on the data-parallel mesh, the blocks on the 2-D one)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    return list(groups.values())


def _clip_and_step(
    state: TrainState, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, max_norm: float | None
) -> torch.Tensor:
    """Clip the global gradient norm (computed per mesh group, then combined), step, zero grads; returns the norm
    (0-dim, on the device, the caller reads it with the step's other metrics; this reads whether it is finite).

    A norm that is not finite (a NaN or inf gradient) skips the optimizer step: the weights and the optimizer's
    moments stay as they were, where one step of AdamW would make every weight NaN and every later push serve them.
    The scheduler steps either way, so the schedule keeps counting updates. The caller sees the norm as not finite.
    """
    sync_tensor_parallel_partial_grads(model, state.mesh)
    groups = _by_mesh([p for p in model.parameters() if p.grad is not None])
    foreach = has_foreach_kernels(state.device)
    squares = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], 2.0, foreach=foreach)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.double() ** 2)
    total = torch.stack(squares).sum().sqrt().float()
    # One host read per update (on XLA it ends the backward's graph there); every rank holds the same global norm, so
    # all of them skip together.
    if bool(torch.isfinite(total)):
        if max_norm is not None:
            for group in groups:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    elif scheduler is not None:
        with warnings.catch_warnings():  # "scheduler stepped before the optimizer": here that is the intent
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if state.cfg.releases_freed_memory:
        release_freed_memory(RELEASE_MIN_FREE_BYTES)  # the gradients just dropped
    cut_graph(state.device)
    return total.detach()


def _update_policy(
    state: TrainState, mbs: list[MicroBatch], counts: tuple[float, float], acc: MetricsAccumulator,
    num_router_tokens: float,
):  # fmt: skip
    num_tokens, num_seqs = counts
    aux_coef = moe_aux_coef(state.algorithm.config, state.model_cfg)
    for mb in mbs:
        logprobs, entropy, hidden = forward_logprobs(state.policy, mb)
        loss, metrics = state.algorithm.policy_loss(mb, logprobs, entropy, num_tokens, num_seqs)
        loss, metrics = add_router_aux_loss(loss, metrics, state.policy, mb, aux_coef, num_router_tokens)
        # The zero term keeps the graph connected for empty micro-batches, so every rank runs the same backward.
        (loss + 0.0 * hidden.sum()).backward()
        acc.add(metrics, float(mb.num_loss_tokens))
        cut_graph(state.device)


def _update_critic(
    state: TrainState, mbs: list[MicroBatch], counts: tuple[float, float], acc: MetricsAccumulator,
    num_router_tokens: float,
):  # fmt: skip
    assert state.critic is not None
    num_tokens, num_seqs = counts
    aux_coef = moe_aux_coef(state.algorithm.config, state.model_cfg)
    for mb in mbs:
        values = _critic_values(state, mb)
        loss, metrics = state.algorithm.value_loss(mb, mb.scatter(values), num_tokens, num_seqs)
        # An MoE critic's routers get the same load-balancing term as the policy's (``critic/loss/moe_aux``).
        loss, metrics = add_router_aux_loss(
            loss, {**metrics, "loss": metrics["value_loss"]}, state.critic, mb, aux_coef, num_router_tokens
        )
        (loss + 0.0 * values.sum()).backward()
        acc.add(metrics, float(mb.num_loss_tokens))
        cut_graph(state.device)


def _read(values: list[torch.Tensor]) -> list[float]:
    """0-dim device tensors as floats, in one transfer."""
    return torch.stack(values).cpu().tolist() if values else []


MAX_STEPS_WITHOUT_UPDATE = 3
"""RL steps in a row whose every policy update was skipped (a gradient norm not finite) after which a run fails: the
loss itself is not finite, and the run would go on pushing the same weights as new versions."""


def _norm_metrics(norms: list[float], model: str, step: int) -> dict[str, float]:
    """``grad_norm`` (mean over the updates that stepped), ``grad_norm_max`` and ``skipped_updates`` (updates whose
    gradient norm was not finite, so skipped: :func:`_clip_and_step`) of ``model``'s updates; warns of skips (on the
    first rank only: every rank skips alike)."""
    finite = [n for n in norms if math.isfinite(n)]
    skipped = len(norms) - len(finite)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning(
            "step %d: %d of %d %s updates skipped: the gradient norm was not finite (NaN or inf; the weights were "
            "left as they were). Repeated skips mean the loss itself is not finite: a learning rate too high for the "
            "model's dtype, or rewards that are not finite", step, skipped, len(norms), model,
        )  # fmt: skip
    return {
        "grad_norm": float(np.mean(finite)) if finite else 0.0,
        "grad_norm_max": float(np.max(finite)) if finite else 0.0,
        "skipped_updates": float(skipped),
    }


def _count_steps_without_update(state: TrainState, norms: list[float]) -> None:
    """Count a step whose every policy update was skipped; ``RuntimeError`` at :data:`MAX_STEPS_WITHOUT_UPDATE` in a
    row, naming what to look at."""
    skipped_all = bool(norms) and not any(math.isfinite(n) for n in norms)
    state.steps_without_update = state.steps_without_update + 1 if skipped_all else 0
    if state.steps_without_update >= MAX_STEPS_WITHOUT_UPDATE:
        raise RuntimeError(
            f"steps {state.step - MAX_STEPS_WITHOUT_UPDATE + 2}-{state.step + 1}: every optimizer update skipped, the "
            "gradient norm not finite (NaN or inf) each time, so the loss itself is not: look for rewards or "
            "advantages that are not finite, or a learning rate too high for the model's dtype (the weights are as "
            "the last finite update left them; resume from the last checkpoint once the cause is fixed)"
        )  # fmt: skip


def rl_step(state: TrainState, batch: RolloutBatch) -> dict[str, float]:
    """One update of ``state.algorithm`` on ``batch`` (every rank passes the same batch); returns the step's metrics.

    Metrics (identical on every rank): ``loss`` and its parts (``policy_loss``, ``kl_loss``, MoE only: ``loss/moe_aux``,
    the unweighted router load-balancing term, see ``trainer.rl.router_aux``; mean per optimizer step),
    token-weighted means (``kl``, ``entropy``, ``clip_frac_low/high`` and with dual-clip ``clip_frac_dual``,
    ``ratio_mean``; the fidelity of the trainer to the rollout engine: ``logprob_gap`` = mean |trainer - rollout|
    log-prob, ``rollout_kl`` = KL(rollout || trainer), ``is_ratio_mean``, ``is_weight_mean``, ``is_frac_capped``,
    ``is_frac_masked``; see README "Metrics"), extremes (``ratio_min/max``, ``logprob_gap_max``,
    ``is_ratio_min/max``), ``grad_norm`` (mean over optimizer steps, before clipping) and ``grad_norm_max``,
    ``skipped_updates`` (optimizer steps skipped for a gradient norm that was not finite),
    ``lr`` (the rate of the step's first optimizer update),
    ``step_s``, ``tokens_per_s`` (prompt + completion tokens of the batch x epochs per second, all ranks), this rank's
    seconds in each phase of the step (``logprobs_s``: old / reference log-probs, values and advantages;
    ``forward_backward_s``: the policy's forward and backward passes; ``optimizer_s``: gradient clipping and the
    optimizer step; PPO: ``critic_s``, the critic's whole update),
    ``num_tokens`` (completion tokens), ``num_samples``, ``overlong_filtered_frac`` (samples the overlong filter took
    out of the loss; with every sample filtered the step makes no update), ``step``, ``policy_version``; with a critic
    (PPO) also ``critic/value_loss``, ``critic/value_error``, ``critic/value_mean``, ``critic/value_clip_frac``,
    ``critic/explained_variance``, ``critic/return_mean``, ``critic/grad_norm``, ``critic/grad_norm_max``,
    ``critic/skipped_updates``, ``critic/lr``, and ``critic/loss`` (the value loss plus, MoE only, the critic routers'
    weighted ``critic/loss/moe_aux``); on a device that compiles
    per shape (``xla``), ``compiled_graphs``: the graphs this step compiled (0 once the step's shapes have all been
    seen).
    """
    start, graphs_before = time.perf_counter(), compiled_graphs(state.device)
    cfg, samples = state.cfg, batch.samples
    if not samples:
        raise ValueError("empty rollout batch: nothing to train on")
    # The rates this step's first update uses (the schedulers step after each update).
    lr = float(state.scheduler.get_last_lr()[0])
    critic_lr = None if state.critic_scheduler is None else float(state.critic_scheduler.get_last_lr()[0])
    trained = _trained_indices(state, samples)
    minis = _minibatches(state, samples, trained, epoch=0)
    plans = [plan_rank_micro_batches(state, samples, idx) for idx in minis]
    # Adapter dropout makes the gradient pass another policy than the engine's: the old log-probs (the importance
    # weights' numerator) then come from the deterministic no-grad pass.
    lora = state.model_cfg.lora
    need_old = cfg.num_epochs * cfg.num_minibatches > 1 or (lora is not None and lora.dropout > 0)
    clock = PhaseClock(state.device)
    if minis:  # empty only when overlong filtering dropped every sample: no update this step
        with clock.phase("logprobs"):
            _no_grad_pass(state, plans, need_old)
            _compute_advantages(state, samples, trained, plans)
            cut_graph(state.device)
    advantages = _advantage_moments(state, plans) if minis else None

    acc, critic_acc = MetricsAccumulator(), MetricsAccumulator()
    grad_norms: list[torch.Tensor] = []
    critic_norms: list[torch.Tensor] = []
    for epoch in range(cfg.num_epochs):
        if epoch > 0 and len(minis) > 1:
            minis, plans = _reshuffled(state, samples, trained, plans, epoch)
        for idx, mbs in zip(minis, plans):
            counts = _mini_counts(samples, idx)
            num_router_tokens = count_router_tokens(samples, idx)
            with clock.phase("forward_backward"):
                _update_policy(state, mbs, counts, acc, num_router_tokens)
            with clock.phase("optimizer"):
                grad_norms.append(
                    _clip_and_step(state, state.policy, state.optimizer, state.scheduler, cfg.grad_clip_norm)
                )
            if state.critic is not None:
                assert state.critic_optimizer is not None, "a critic is built with its optimizer"
                with clock.phase("critic"):
                    _update_critic(state, mbs, counts, critic_acc, num_router_tokens)
                    critic_norms.append(_clip_and_step(
                        state, state.critic, state.critic_optimizer, state.critic_scheduler, cfg.grad_clip_norm
                    ))  # fmt: skip
    num_updates = max(1, cfg.num_epochs * len(minis))
    # Sums over every update of the step: loss terms as the mean per optimizer step, counts per pass over the batch.
    def per_update(k: str, v: float) -> float:
        if k == "loss" or k.endswith("_loss") or k.startswith("loss/"):
            return v / num_updates
        return v / cfg.num_epochs if k.startswith("num_") else v

    metrics = {k: per_update(k, v) for k, v in acc.reduce(mesh_device_type(state.device), state.dp_group).items()}
    if state.critic is not None:
        critic_metrics = explained_variance(critic_acc.reduce(mesh_device_type(state.device), state.dp_group))
        metrics.update({f"critic/{k}": per_update(k, v) for k, v in critic_metrics.items()})
        assert critic_lr is not None
        metrics["critic/lr"] = critic_lr
    norms, critic_norm_values = _read(grad_norms), _read(critic_norms)
    _count_steps_without_update(state, norms)
    state.step += 1  # the step's number in its metrics and messages from here on (train/step)
    if critic_norm_values:
        metrics.update({f"critic/{k}": v for k, v in _norm_metrics(critic_norm_values, "critic", state.step).items()})
    state.policy_version += 1
    elapsed = time.perf_counter() - start
    metrics["overlong_filtered_frac"] = (len(samples) - len(trained)) / len(samples)
    if advantages is not None:
        metrics.update(_advantage_metrics(*advantages))
    metrics.update(_norm_metrics(norms, "policy", state.step))
    metrics.update(
        lr=lr, step_s=elapsed,
        tokens_per_s=batch.num_tokens * cfg.num_epochs / elapsed, num_samples=float(len(samples)),
        step=float(state.step), policy_version=float(state.policy_version), **clock.metrics(),
    )  # fmt: skip
    graphs_after = compiled_graphs(state.device)
    if graphs_before is not None and graphs_after is not None:
        metrics["compiled_graphs"] = float(graphs_after - graphs_before)
    return metrics


def sft_step(state: TrainState, samples: Sequence[Sample], lr: float | None = None) -> dict[str, float]:
    """One supervised step (mean NLL of the completion tokens over the whole batch) on the policy.

    Metrics: ``sft_loss`` (the NLL), ``loss`` (what was minimised: the NLL plus, MoE only, the router load-balancing
    term ``loss/moe_aux`` weighted as in :func:`rl_step`), ``num_tokens``, ``grad_norm``, ``step_s``,
    ``policy_version``. ``lr`` overrides the scheduled learning rate for this step; the schedule itself does not
    advance (it belongs to the RL steps). The weights change, so ``policy_version`` is bumped.
    """
    start = time.perf_counter()
    mbs = plan_rank_micro_batches(state, samples, range(len(samples)))
    num_tokens, _ = _mini_counts(samples, range(len(samples)))
    aux_coef = moe_aux_coef(state.algorithm.config, state.model_cfg)
    num_router_tokens = count_router_tokens(samples, range(len(samples)))
    acc = MetricsAccumulator()
    for mb in mbs:
        logprobs, _, hidden = forward_logprobs(state.policy, mb)
        loss = sft_loss(logprobs, mb.loss_mask, "token_mean", num_tokens=num_tokens)
        metrics: Metrics = {"loss": loss.detach(), "sft_loss": loss.detach(), "num_tokens": float(mb.num_loss_tokens)}
        loss, metrics = add_router_aux_loss(loss, metrics, state.policy, mb, aux_coef, num_router_tokens)
        (loss + 0.0 * hidden.sum()).backward()
        acc.add(metrics, float(mb.num_loss_tokens))
        cut_graph(state.device)
    saved = [g["lr"] for g in state.optimizer.param_groups]
    if lr is not None:
        for g in state.optimizer.param_groups:
            g["lr"] = lr
    norm = float(_clip_and_step(state, state.policy, state.optimizer, None, state.cfg.grad_clip_norm))
    for g, old in zip(state.optimizer.param_groups, saved):
        g["lr"] = old
    state.policy_version += 1
    out = acc.reduce(mesh_device_type(state.device), state.dp_group)
    norms = _norm_metrics([norm], "warm-start", state.policy_version)
    out.update(grad_norm=norms["grad_norm"], skipped_updates=norms["skipped_updates"],
               step_s=time.perf_counter() - start, policy_version=float(state.policy_version))  # fmt: skip
    return out
