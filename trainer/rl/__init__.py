"""RL math of the policy update, one idea per module, pure functions on ``[B, T]`` tensors with a completion mask.

``config`` (the algorithm's typed config, no torch), ``advantages`` (GRPO/RLOO/GAE), ``policy_loss`` (PPO clip, DAPO
clip-higher, GSPO), ``kl`` (k1/k2/k3), ``entropy``, ``value_loss``, ``importance`` (truncated IS against the rollout
engine), ``sft``, ``aggregation`` (token/sequence means), and ``loss``, which composes them for one micro-batch;
``router_aux`` adds the MoE router load-balancing term to it.
"""
