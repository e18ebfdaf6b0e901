"""The registry's kernels inside a transformers model (`model.spec = "hf"`).

transformers lets two pieces of its Qwen3 / Qwen3-MoE forward be replaced by name, and titanite
plugs its ops in there, so a kernel registered once serves both backends:

- `attention`, through transformers' AttentionInterface: every attention module gets an
  `attention` call site (`...self_attn.attention`). Whole causal sequences and block-causal
  masks (titanite's packed documents) go to the op; any other mask (padding, a KV cache
  during generation) goes to transformers' own SDPA path.
- `moe.dispatch` and `moe.experts`, through its ExpertsInterface: every experts module
  (`...mlp.experts`, weights gate_up_proj [E, 2I, H] and down_proj [E, H, I], the layout of
  titanite's native experts) gets both call sites. transformers' router stays its own.

Not reachable without replacing transformers' modules, which titanite does not do:
`rms_norm` and `rope` (transformers swaps those only for Hub `kernels` packages), `swiglu`
(its MLP calls the activation directly), `moe.router` (a plain module), and `loss`
(transformers' head returns the logits; the trainer takes the cross-entropy from them).
"""

from __future__ import annotations

import torch
from torch import nn

from titanite.kernels.attach import Kernel
from titanite.kernels.reference_ops import block_causal_mask

NAME = "titanite"
_registered = False
_mask_cache: list = [None, None]  # (the last mask seen, its document ids or _OTHER)
_OTHER = object()  # a mask the attention op cannot express


def _document_ids(mask: torch.Tensor | None, q_len: int, kv_len: int):
    """None for no mask; int64 [B, S] document ids for a causal / block-causal mask; _OTHER else.
    Every layer sees the same mask tensor, so the answer (one host sync) is computed once."""
    if mask is None:
        return None
    if _mask_cache[0] is mask:
        return _mask_cache[1]
    docs = _OTHER
    if q_len == kv_len and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[-1] == kv_len:
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # [B, S, S]
        S = kv_len
        # A document starts where a token may not see its predecessor.
        starts = torch.ones(allowed.shape[0], S, dtype=torch.bool, device=mask.device)
        idx = torch.arange(1, S, device=mask.device)
        starts[:, 1:] = ~allowed[:, idx, idx - 1]
        candidate = starts.long().cumsum(-1)
        if torch.equal(block_causal_mask(candidate)[:, 0], allowed.expand(candidate.shape[0], S, S)):
            docs = candidate
    _mask_cache[:] = [mask, docs]
    return docs


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs):
    """AttentionInterface function: q [B, Hq, S, D], k/v [B, Hk, S, D] -> ([B, S, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel = getattr(module, "attention", None)
    plain = (isinstance(kernel, Kernel) and dropout == 0.0 and is_causal in (None, True)
             and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
             and query.shape[2] == key.shape[2] and getattr(module, "is_causal", True))
    docs = _document_ids(attention_mask, query.shape[2], key.shape[2]) if plain else _OTHER
    if docs is _OTHER:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = kernel(query, key, value, scale) if docs is None else kernel(query, key, value, scale, docs)
    return out.transpose(1, 2).contiguous(), None


def _experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """ExpertsInterface function: tokens [T, H], ids [T, k], weights [T, k] -> [T, H]."""
    def run(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return module.experts_kernel(rows, counts, module.gate_up_proj, module.down_proj)

    return module.dispatch(hidden_states, top_k_index, top_k_weights, module.num_experts, run)


def _register_interfaces() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # masks as SDPA gets them: None when causal
    ExpertsInterface.register(NAME, _experts)
    _registered = True


def _is_titanite_layout_experts(module: nn.Module) -> bool:
    """transformers' fused experts whose layout is titanite's: gate then up, not transposed, no bias."""
    w = getattr(module, "gate_up_proj", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 3 and hasattr(module, "down_proj")
            and getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True)
            and not getattr(module, "_is_expert_parallel", False))


def install(hf: nn.Module) -> None:
    """Route a transformers PreTrainedModel's attention and experts through titanite call sites.

    Adds `attention` to each attention module and `dispatch` + `experts_kernel` to each experts
    module (bound later by `kernels.attach`), then selects the `titanite` implementations.
    """
    _register_interfaces()
    attention, experts = 0, 0
    for module in hf.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "scaling"):
            module.attention = Kernel("attention")
            attention += 1
        elif _is_titanite_layout_experts(module):
            module.dispatch = Kernel("moe.dispatch")
            module.experts_kernel = Kernel("moe.experts")
            experts += 1
    if attention:
        hf.set_attn_implementation(NAME)
    if experts:
        hf.set_experts_implementation(NAME)
