"""Declarative HF <-> our parameter name tables, one per family.

Each table maps an HF checkpoint name (``{}`` = layer index) to our parameter name, or to ``None`` for HF names that
are dropped on load (non-persistent buffers some old checkpoints carry). An HF name with one more ``{}`` than ours is
stacked: its extra index (the expert) is our dim 0 (``model.layers.{}.mlp.experts.{}.gate_proj.weight`` ->
``layers.{}.moe.experts.w1[e]``). All other tensors keep the HF layout exactly, so shards map with unchanged offsets.
With tied embeddings ``lm_head.weight`` is neither saved nor loaded (as HF ``save_pretrained`` does; vLLM ties it).
"""

from __future__ import annotations

import re

from trainer.models.config import Family

__all__ = ["HF_NAME_TABLES", "NameMap", "name_map"]

_ATTENTION = {
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
}
_QK_NORM = {
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
}
_DENSE_MLP = {
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
}
_MOE_MLP = {
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.weight",
    "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.experts.w1",
    "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.experts.w3",
    "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.experts.w2",
}
_OUTER = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}

HF_NAME_TABLES: dict[Family, dict[str, str | None]] = {
    "llama3": {**_OUTER, **_ATTENTION, **_DENSE_MLP},
    "qwen3": {**_OUTER, **_ATTENTION, **_QK_NORM, **_DENSE_MLP},
    "qwen3_moe": {**_OUTER, **_ATTENTION, **_QK_NORM, **_MOE_MLP},
}


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


class NameMap:
    """A compiled name table: HF name -> (our name, expert index or None), and our name -> HF name(s)."""

    def __init__(self, table: dict[str, str | None]):
        self._rules = [(_pattern(hf), hf, ours, _pattern(ours) if ours else None) for hf, ours in table.items()]

    def to_ours(self, hf_name: str) -> tuple[str, int | None] | None:
        """Our name and, for stacked tensors, the index along our dim 0; ``None`` if the name is dropped.

        Raises ``KeyError`` for a name the table does not know.
        """
        for hf_re, _, ours, _ in self._rules:
            m = hf_re.match(hf_name)
            if m is None:
                continue
            if ours is None:
                return None
            idx = [int(g) for g in m.groups()]
            n_ours = ours.count("{}")
            return ours.format(*idx[:n_ours]), (idx[n_ours] if len(idx) > n_ours else None)
        raise KeyError(hf_name)

    def to_hf(self, our_name: str) -> tuple[str, bool]:
        """(HF name, stacked). For stacked tensors the HF name keeps one ``{}`` for the index along our dim 0.

        Raises ``KeyError`` for a name the table does not know.
        """
        for _, hf, _ours, ours_re in self._rules:
            m = ours_re.match(our_name) if ours_re else None
            if m is None:
                continue
            groups = list(m.groups())
            stacked = hf.count("{}") > len(groups)
            return hf.format(*groups, *(["{}"] if stacked else [])), stacked
        raise KeyError(our_name)


_MAPS: dict[Family, NameMap] = {}


def name_map(family: Family) -> NameMap:
    """The compiled :class:`NameMap` of ``family`` (cached)."""
    if family not in _MAPS:
        _MAPS[family] = NameMap(HF_NAME_TABLES[family])
    return _MAPS[family]
