"""The registry's kernels inside a transformers model (`model.spec = "hf"`): all eight ops.

A kernel registered once serves both backends. transformers' Qwen3 / Qwen3-MoE offer a
replacement seam for some ops, and titanite uses those:

- `attention`, through transformers' AttentionInterface: every attention module gets an
  `attention` call site. Causal attention goes to the op: whole sequences, steps into a KV cache
  (the queries are the last positions, the op's bottom-right contract), and packed documents,
  given as document ids (the keyword argument `DOCUMENTS_KWARG`, how titanite's own forward
  passes them: no mask is built and nothing is read on the host, and activation checkpointing's
  recomputation gets them too) or as a block-causal 4-D mask (one host read per
  forward to recognise it). Any other 4-D mask goes to transformers' own SDPA path.
  transformers builds no masks for this implementation, so a 2-D padding mask with padding in
  it is refused (`ValueError`) rather than silently ignored; an all-ones one (what `generate()`
  passes) is fine.
- `moe.dispatch` and `moe.experts`, through its ExpertsInterface: every experts module
  (weights gate_up_proj [E, 2I, H] and down_proj [E, H, I], the layout of titanite's native
  experts) gets both call sites. Expert parallelism hooks in here too (`run_experts`).

For the other five, transformers' only seam is `use_kernel_forward_from_hub` (RMSNorm, RoPE),
which swaps in layers fetched from the Hugging Face Hub by the `kernels` package: it cannot take
a function registered in this process, needs the network, and without the package (titanite does
not install it) the decorator does nothing. Its loss function receives the logits, so it cannot
avoid them. So for those, and only here, titanite replaces the *instance* forward of the known
Qwen3 modules (the classes are untouched, other models in the process keep transformers' code):

- RMSNorm (`Qwen3RMSNorm`, `Qwen3MoeRMSNorm`, the per-head q/k norms included) -> `rms_norm`;
- attention (`Qwen3Attention`, `Qwen3MoeAttention`) -> the same projections and norms, then the
  `rope` op, then the attention interface as above (a KV cache is honoured);
- the dense MLP (`Qwen3MLP`, `Qwen3MoeMLP`, SiLU only) -> `swiglu`;
- the MoE router (`Qwen3MoeTopKRouter`) -> `moe.router`, in fp32 as the native router; it also
  leaves the layer's `RoutingRecord` (`last_routing`) for the auxiliary loss and telemetry;
- the head (`lm_head`) -> `loss` on the final hidden states and the head weight, while the
  labels are set (`labels(...)`): the chunked loss never holds the [tokens, V] logits here either.
  Without labels (a vocabulary-sharded head, evaluation of logits, generation) it returns them.

Every replaced forward computes what transformers' does with the reference ops (tested against
unmodified transformers, forward and backward). Call sites keep transformers' module names
(`hf.model.layers.0.self_attn.q_norm.kernel`); `native_name` gives the native model's name for
the same place (`layers.0.attention.q_norm.kernel`), so one `[kernels]` glob selects the same
modules under either `model.spec`.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import types
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from titanite.kernels import context_parallel
from titanite.kernels.attach import Kernel
from titanite.kernels.head_loss import head_loss
from titanite.kernels.hf_delta import DOCUMENTS_KWARG, install_delta
from titanite.kernels.reference_ops import block_causal_mask
from titanite.kernels.routing import RoutingRecord, expert_counts

NAME = "titanite"
_registered = False
_mask_cache: list = [None, None]  # (the last mask seen, its document ids or _OTHER)
_OTHER = object()  # a mask the attention op cannot express
_guarded: weakref.WeakSet = weakref.WeakSet()  # models whose padding masks are refused
_LABELS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("titanite_hf_labels", default=None)


# -- transformers' interfaces: attention and experts ---------------------------------------

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
    # A keyword argument, not a context variable: transformers hands a forward's keyword
    # arguments down to every attention call, and activation checkpointing keeps them for the
    # recomputation inside the backward (where a context set around the forward has ended).
    given = kwargs.pop(DOCUMENTS_KWARG, None)
    from_ids = given is not None and attention_mask is None and query.shape[2] == key.shape[2]
    # titanite's packed documents come as ids: no mask to read back, and none built for the op
    docs = given if from_ids else _document_ids(attention_mask, query.shape[2], key.shape[2])
    plain = (isinstance(kernel, Kernel) and dropout == 0.0 and is_causal in (None, True)
             and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
             and getattr(module, "is_causal", True))
    if docs is _OTHER or not plain:
        if context_parallel.current() is not None:
            raise RuntimeError(f"{type(module).__name__}: context parallelism needs titanite's attention call site, "
                               "but this call (a mask it cannot express, dropout or a sliding window) would go to "
                               "transformers' own attention, which sees only this rank's chunks")
        if from_ids:  # transformers' own attention takes the documents as a mask
            attention_mask = block_causal_mask(given)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = kernel(query, key, value, scale) if docs is None else kernel(query, key, value, scale, docs)
    return out.transpose(1, 2).contiguous(), None


def _experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """ExpertsInterface function: tokens [T, H], ids [T, k], weights [T, k] -> [T, H]."""
    return module.dispatch(hidden_states, top_k_index, top_k_weights, module.num_experts, module.run_experts)


def run_local_experts(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts on one device: rows [N, H] sorted by expert, counts [E] -> [N, H]."""
    return module.experts_kernel(rows, counts, module.gate_up_proj, module.down_proj)


def _register_interfaces() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    # No mask function is registered for this implementation, so transformers prepares no mask
    # of its own: a 4-D mask it is given (titanite's block-causal one) reaches `_attention` as is,
    # and without one the attention is causal. transformers' mask preparation would otherwise
    # infer packed documents from restarting position ids (the native model never does) with a
    # host read on every forward.
    AttentionInterface.register(NAME, _attention)
    ExpertsInterface.register(NAME, _experts)
    _registered = True


def _is_titanite_layout_experts(module: nn.Module) -> bool:
    """transformers' fused experts whose layout is titanite's: gate then up, not transposed, no bias."""
    w = getattr(module, "gate_up_proj", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 3 and hasattr(module, "down_proj")
            and getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True)
            and not getattr(module, "_is_expert_parallel", False))


# -- replaced instance forwards --------------------------------------------------------------

def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return self.kernel(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple,
                       attention_mask: torch.Tensor | None, cache=None, past_key_values=None, **kwargs):
    """transformers' Qwen3 attention with the `rope` op: [B, S, H] -> ([B, S, H], weights or None)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cache = cache if cache is not None else past_key_values  # the name before transformers 5.40
    B, S = hidden_states.shape[:2]
    per_head = (B, S, -1, self.head_dim)
    q = self.q_norm(self.q_proj(hidden_states).view(per_head)).transpose(1, 2)  # [B, Hq, S, D]
    k = self.k_norm(self.k_proj(hidden_states).view(per_head)).transpose(1, 2)  # [B, Hk, S, D]
    v = self.v_proj(hidden_states).view(per_head).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = self.rope(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if attend is None:
        raise RuntimeError(f"attention implementation {self.config._attn_implementation!r} is not registered")
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(B, S, -1).contiguous()), weights


def _router_forward(self: nn.Module, hidden_states: torch.Tensor):
    """[T, H] -> (router log-probabilities [T, E], top-k weights fp32 [T, k], top-k ids [T, k]).

    The routing runs in fp32 as the native router's (under bf16 autocast too). Its first output
    is what transformers records as the router logits (output_router_logits): the
    log-probabilities, whose softmax is the router's probabilities."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    with torch.autocast(x.device.type, enabled=False):
        # Qwen3.5-MoE's router always renormalises its top-k (it has no norm_topk_prob).
        norm = getattr(self, "norm_topk_prob", True)
        probs, weights, ids = self.kernel(x.float(), self.weight.float(), self.top_k, norm, None)
    with torch.no_grad():
        counts = expert_counts(ids, self.num_experts)
    self.last_routing = RoutingRecord(counts, probs.sum(dim=0), x.shape[0])
    return probs.clamp_min(torch.finfo(probs.dtype).tiny).log(), weights, ids  # finite where a probability underflowed


def _head_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Logits [..., V], or with `labels(...)` set the fp32 cross-entropy through `loss` (summed, or
    per row inside loss_per_row())."""
    labels_now = _LABELS.get()
    if labels_now is None:
        return F.linear(hidden_states, self.weight)
    return head_loss(self.loss, hidden_states, self.weight, labels_now)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: torch.Tensor | None) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def labels(value: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """While set, an installed model's head returns the summed loss of `value` (int64 [B, S],
    IGNORE_INDEX skipped) in place of the logits."""
    return _setting(_LABELS, value)


def installed(hf: nn.Module) -> bool:
    """Whether `install` gave this transformers model titanite's attention call sites."""
    return hf in _guarded


def _refuse_padding(_module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an installed model: no mask function is registered for titanite's
    attention, so a 2-D padding mask would be dropped; refuse one that pads."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise ValueError("a transformers model with titanite's kernels installed does not apply 2-D "
                         "padding masks: pack the sequences (document ids) or pass a 4-D mask")


def _replace_forward(module: nn.Module, fn: Callable, **sites: str) -> None:
    for attr, op in sites.items():
        setattr(module, attr, Kernel(op))
    module.forward = types.MethodType(fn, module)


def _module_classes() -> dict[str, tuple[type, ...]]:
    """Qwen3's modules, and the Qwen3.5 / Qwen3-Next ones that compute the same math (their
    zero-centred norms and gated attention are left to transformers; their Gated DeltaNet
    layers are hf_delta.py's)."""
    from transformers.models.qwen3 import modeling_qwen3 as dense
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hybrid
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hybrid_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe as moe
    from transformers.models.qwen3_next import modeling_qwen3_next as next_

    return {"norm": (dense.Qwen3RMSNorm, moe.Qwen3MoeRMSNorm),
            "attention": (dense.Qwen3Attention, moe.Qwen3MoeAttention),
            "mlp": (dense.Qwen3MLP, moe.Qwen3MoeMLP, hybrid.Qwen3_5MLP, hybrid_moe.Qwen3_5MoeMLP, next_.Qwen3NextMLP),
            "router": (moe.Qwen3MoeTopKRouter, hybrid_moe.Qwen3_5MoeTopKRouter, next_.Qwen3NextTopKRouter)}


def install(hf: nn.Module) -> dict[str, int]:
    """Give a transformers Qwen3 / Qwen3-MoE / Qwen3.5 / Qwen3-Next causal LM titanite's kernel call
    sites (bound later by `kernels.attach`, like the native model's; the Gated DeltaNet layers'
    in hf_delta.py). Returns the number of modules per kind."""
    _register_interfaces()
    classes = _module_classes()
    found = dict.fromkeys(("norm", "attention", "mlp", "router", "experts", "head"), 0)
    for module in hf.modules():
        if isinstance(module, classes["norm"]):
            _replace_forward(module, _rms_norm_forward, kernel="rms_norm")
            found["norm"] += 1
        elif isinstance(module, classes["attention"]):
            _replace_forward(module, _attention_forward, rope="rope", attention="attention")
            found["attention"] += 1
        elif isinstance(module, classes["mlp"]) and module.config.hidden_act == "silu":
            _replace_forward(module, _mlp_forward, swiglu="swiglu")
            found["mlp"] += 1
        elif isinstance(module, classes["router"]):
            _replace_forward(module, _router_forward, kernel="moe.router")
            module.last_routing = None
            found["router"] += 1
        elif _is_titanite_layout_experts(module):
            module.dispatch = Kernel("moe.dispatch")
            module.experts_kernel = Kernel("moe.experts")
            module.run_experts = types.MethodType(run_local_experts, module)
            found["experts"] += 1
    found["gated_delta"] = install_delta(hf)
    head = hf.get_output_embeddings()
    if isinstance(head, nn.Linear) and head.bias is None:
        _replace_forward(head, _head_forward, loss="loss")
        found["head"] = 1
    if found["attention"] or found["gated_delta"]:  # a hybrid model's attention uses the interface as it is
        hf.set_attn_implementation(NAME)
        if hf not in _guarded:
            hf.register_forward_pre_hook(_refuse_padding, with_kwargs=True)
            _guarded.add(hf)
    if found["experts"]:
        hf.set_experts_implementation(NAME)
    return found


# -- the native model's names for the same places ---------------------------------------------

_NATIVE_NAMES = [(re.compile(p), r) for p, r in (
    (r"^hf\.", ""),
    (r"^model\.", ""),
    (r"\bembed_tokens\b", "tok_embeddings"),
    (r"\bself_attn\.attention$", "attention.attend"),
    (r"\bself_attn\b", "attention"),
    (r"\binput_layernorm\b", "attention_norm"),
    (r"\bpost_attention_layernorm\b", "ffn_norm"),
    (r"\bmlp\.gate\b", "feed_forward.router"),
    (r"\bmlp\.experts\.dispatch$", "feed_forward.dispatcher.kernel"),
    (r"\bmlp\.experts\.experts_kernel$", "feed_forward.experts.kernel"),
    (r"\bmlp\b", "feed_forward"),
    (r"^lm_head\b", "output"),
)]


def native_name(fqn: str) -> str:
    """The native model's name for a transformers module or call-site FQN:
    `hf.model.layers.0.self_attn.q_norm.kernel` -> `layers.0.attention.q_norm.kernel`."""
    for pattern, repl in _NATIVE_NAMES:
        fqn = pattern.sub(repl, fqn)
    return fqn
