"""One actor's Ray resource request as a dict (what a placement-group bundle holds) and as Ray actor options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["actor_options"]


def actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """The ``ray.remote(...).options()`` keywords that ask for exactly ``resources`` (e.g. ``{"CPU": 2, "TPU": 4}``):
    Ray takes CPUs and GPUs as ``num_cpus`` / ``num_gpus`` and refuses them inside ``resources``."""
    custom = {name: amount for name, amount in resources.items() if name not in ("CPU", "GPU")}
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0)}
    if custom:
        options["resources"] = custom
    return options
