"""What one trainer rank holds in memory, estimated from the configs alone (no torch): training state, the blocks
FSDP gathers, and the activations of one micro-batch. For sizing a recipe to its chips before anything starts
(``tests/deploy`` checks the hardware recipes with it); ``benchmarks/activation_checkpoint.py`` measures the real
figures.

- training state: float32 master weights, their gradients and AdamW's two moments, 16 bytes per trained parameter,
  4 per frozen one (a LoRA base), sharded over the ranks by FSDP;
- gathered blocks: FSDP2 unshards a block for its forward and backward while prefetching the next, and in backward
  holds the block's unsharded gradients in the compute dtype and again in the reduction dtype for the reduce-scatter.
  With expert parallelism a rank gathers only its own experts (``trainer.expert_parallel``);
- the gathered root: FSDP2's root unit (token embedding, final norm, an untied output head) stays unsharded from a
  micro-batch's forward to the end of its backward, where its gradient joins it, again in the reduction dtype. With
  the vocabulary split (``trainer.parallelism.vocab_parallel``) the matrices stay sharded instead (under tensor
  parallelism FSDP gathers this rank's rows of them only);
- activations: what autograd keeps from one micro-batch's forward for its backward. A block without checkpointing
  keeps its normalised inputs, the query/key/value projections before and after their norms and RoPE, the attention
  output and the feed-forward's four hidden-width tensors (dense SwiGLU, or the ``top_k`` experts' per routed token);
  a checkpointed block keeps its input only, and during backward one block's intermediates exist again at a time.
  The output head adds its own buffers (``chunked``: three ``[chunk, vocab]`` float32 blocks; ``cached`` and
  ``dense``: ``[tokens, vocab]`` float32).
"""

from __future__ import annotations

from trainer.config import ActivationCheckpointConfig
from trainer.models.config import LoRAConfig, ModelConfig
from weight_sync.spec import itemsize

__all__ = [
    "activation_bytes",
    "adapter_params",
    "block_activation_values",
    "gathered_block_bytes",
    "gathered_root_bytes",
    "train_state_bytes",
]


def adapter_params(model: ModelConfig, lora: LoRAConfig) -> int:
    """Parameters of LoRA adapters on ``lora.target_modules`` of every block: ``rank x (in + out)`` each; on the
    targeted expert weights (``lora.target_parameters``) that per expert."""
    sides = model.lora_target_sides()
    per_block = sum(lora.rank * sum(sides[t]) for t in lora.target_modules)
    if model.moe is not None:
        per_block += model.moe.num_experts * sum(lora.rank * sum(sides[t]) for t in lora.target_parameters)
    return model.num_layers * per_block


def train_state_bytes(model: ModelConfig, num_ranks: int = 1) -> float:
    """Bytes of float32 weights + gradients + AdamW moments per rank (FSDP shards all of them evenly); with
    ``model.lora`` the base is frozen (weights only) and the adapters train."""
    if model.lora is None:
        return 16 * model.num_params / num_ranks
    return (4 * model.num_params + 16 * adapter_params(model, model.lora)) / num_ranks


def gathered_block_bytes(
    model: ModelConfig, expert_parallel_degree: int = 1, param_dtype: str = "float32", reduce_dtype: str = "float32"
) -> float:
    """Bytes of unsharded blocks at the peak of a block's backward (see the module docstring): two blocks' parameters
    and one block's gradients in ``param_dtype``, those gradients again in ``reduce_dtype``."""
    params = model.block_params(expert_parallel_degree)
    return params * (3 * itemsize(param_dtype) + itemsize(reduce_dtype))


def gathered_root_bytes(
    model: ModelConfig,
    vocab_parallel: bool = False,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    tensor_parallel_degree: int = 1,
) -> float:
    """Bytes of FSDP2's unsharded root unit at the end of a backward (see the module docstring): its parameters (the
    token embedding, the untied output head, the final norm; with ``vocab_parallel`` the norm alone, or under tensor
    parallelism the norm and this rank's ``1 / tensor_parallel_degree`` of the matrices' rows) in ``param_dtype``, and
    unless ``model.lora`` freezes them their gradients in ``param_dtype`` and ``reduce_dtype``."""
    matrices = (1 if model.tie_embeddings else 2) * model.vocab_size * model.dim
    if vocab_parallel:
        matrices = matrices // tensor_parallel_degree if tensor_parallel_degree > 1 else 0
    params = model.dim + matrices
    grads = 0 if model.lora is not None else params
    return params * itemsize(param_dtype) + grads * (itemsize(param_dtype) + itemsize(reduce_dtype))


def block_activation_values(model: ModelConfig) -> int:
    """Values one token leaves saved for backward in one block without checkpointing (see the module docstring)."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    attention = 2 * model.dim + 2 * (q + kv) * (2 if model.qk_norm else 1) + kv + 2 * q
    if model.moe is None:
        ffn = 2 * model.dim + 4 * model.ffn_hidden_dim
    else:  # router input and probabilities, each routed copy of the token, and its expert's hidden tensors
        moe = model.moe
        ffn = 2 * model.dim + moe.num_experts + moe.top_k * (2 * model.dim + 4 * moe.expert_ffn_hidden_dim)
    return attention + ffn


def activation_bytes(
    model: ModelConfig,
    tokens: int,
    checkpoint: ActivationCheckpointConfig | None = None,
    dtype: str = "float32",
    head_tokens: int | None = None,
) -> float:
    """Bytes of activations one forward + backward of ``tokens`` tokens holds at its peak, with ``checkpoint``'s blocks
    recomputed (None: none), in compute dtype ``dtype``; ``head_tokens`` (default: all) are the positions the output
    head runs on (an RL loss reads completion positions only)."""
    size = itemsize(dtype)
    per_block = block_activation_values(model) * tokens * size
    checkpointed = 0 if checkpoint is None else len(checkpoint.checkpointed_blocks(model.num_layers))
    kept = (model.num_layers - checkpointed) * per_block
    inputs = checkpointed * model.dim * tokens * size
    recompute = per_block if checkpointed else 0
    head_tokens = tokens if head_tokens is None else head_tokens
    chunked = model.output_head in ("chunked", "fused_pallas")
    rows = min(model.output_chunk_size, head_tokens) if chunked else head_tokens
    head = 3 * rows * model.vocab_size * 4
    return kept + inputs + recompute + head
