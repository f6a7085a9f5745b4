"""RL math of the policy update: the algorithms, and the pure functions on ``[B, T]`` tensors with a completion mask
that they compose.

``algorithms`` holds one object per ``[algorithm] type`` (GRPO, PPO: whether a critic is trained, how advantages are
computed, the losses) and the registry; adding an algorithm starts there. ``config`` (the algorithm's typed config,
no torch), ``advantages`` (GRPO/RLOO/GAE, whitening), ``policy_loss`` (PPO clip and dual-clip, DAPO clip-higher,
GSPO), ``kl`` (k1/k2/k3), ``entropy``, ``value_loss``, ``importance`` (truncated or masked IS against the rollout
engine, and the trainer/engine fidelity metrics), ``sft``, ``aggregation`` (token/sequence means), and ``loss``,
which composes the policy loss of one micro-batch; ``router_aux`` adds the MoE router load-balancing term to it.
"""
