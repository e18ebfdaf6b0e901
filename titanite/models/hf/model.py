"""A transformers causal LM behind titanite's model interface.

`HFCausalLM` owns the transformers model as `self.hf`, so its state-dict keys are
`hf.` + transformers' in-memory names. It adds what a model built on the meta device and
materialised with `to_empty` needs and transformers does not do at that point: re-tying the
embedding and the head, and recomputing the RoPE buffers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import ModelOutput

from titanite import kernels
from titanite.models.qwen3.args import Qwen3Args
from titanite.models.stage import Part


class HFCausalLM(nn.Module):
    def __init__(self, hf: PreTrainedModel, args: Qwen3Args) -> None:
        super().__init__()
        self.hf = hf
        self.args = args  # the same architecture in titanite's terms (FLOPs, MoE settings)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                part: Part | None = None) -> torch.Tensor:
        """input_ids: [B, S] int64 -> logits [B, S, V] (with labels: see `run`). document_ids:
        see `run`. part: run only these decoder layers (a pipeline stage), as the native model's
        forward does: hidden states in unless first, hidden states out unless last."""
        if part is None:
            return self.run(input_ids, position_ids, document_ids, labels).logits
        from titanite.kernels.hf import DOCUMENTS_KWARG, installed
        from titanite.kernels.hf import labels as head_labels

        model = self.hf.model
        h = model.embed_tokens(input_ids) if part.first else input_ids
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).expand(h.shape[:2])
        kw = {}
        mask = None
        if document_ids is not None and installed(self.hf):
            kw[DOCUMENTS_KWARG] = document_ids
        elif document_ids is not None:
            mask = kernels.block_causal_mask(document_ids)
        self._forget_rope_length()
        position_embeddings = model.rotary_emb(h, position_ids)
        for i in part.layers:
            h = model.layers[i](h, attention_mask=mask, position_embeddings=position_embeddings,
                                position_ids=position_ids, use_cache=False, **kw)
        if not part.last:
            return h
        h = model.norm(h)
        with head_labels(labels):
            return self.hf.lm_head(h)

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
            document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> ModelOutput:
        """The transformers forward without a KV cache. document_ids: [B, S] int, optional: a
        token attends only to earlier tokens of its own document (packed samples).

        labels: int64 [B, S], only once titanite's kernels are installed (kernels/hf.py): the
        head then computes the summed cross-entropy through the `loss` op, and the output's
        `logits` is that fp32 scalar (the [B, S, V] logits are never built)."""
        from titanite.kernels.hf import DOCUMENTS_KWARG, installed
        from titanite.kernels.hf import labels as head_labels

        # With titanite's attention installed the document ids travel as they are (no mask is
        # built or read back); transformers' own attention gets the block-causal mask.
        mask = None
        if document_ids is not None and not installed(self.hf):
            mask = kernels.block_causal_mask(document_ids)
        # The MoE auxiliary loss is the handle's (from the routers' records), not transformers'.
        kw = {"output_router_logits": False} if self.args.is_moe else {}
        if document_ids is not None and mask is None:
            kw[DOCUMENTS_KWARG] = document_ids
        self._forget_rope_length()
        with head_labels(labels):
            return self.hf(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False, **kw)

    # -- after materialising ----------------------------------------------------------------

    def tie(self) -> None:
        """Re-tie the head to the embedding. `to_empty` gives each module its own new tensor,
        which would silently train the two as separate weights."""
        if not self.args.tie_word_embeddings:
            return
        self.hf.tie_weights()
        assert self.hf.get_output_embeddings().weight is self.hf.get_input_embeddings().weight

    def init_buffers(self) -> None:
        """Re-tie, and recompute the RoPE inverse frequencies, which `to_empty` leaves as
        uninitialised memory (they are non-persistent: no checkpoint restores them)."""
        self.tie()
        for name, module in self.hf.named_modules():
            own = {n for n, _ in module.named_buffers(recurse=False)}
            if not own:
                continue
            assert own <= {"inv_freq", "original_inv_freq"} and hasattr(module, "rope_type"), \
                f"{name} has buffers {sorted(own)} that titanite does not know how to rebuild"
            device = module.inv_freq.device
            fn = (module.compute_default_rope_parameters if module.rope_type == "default"
                  else ROPE_INIT_FUNCTIONS[module.rope_type])
            inv_freq, module.attention_scaling = fn(module.config)
            # Reassigned, not copied into: it stays fp32 even after model.to(bfloat16).
            module.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
            module.original_inv_freq = module.inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len

    def _forget_rope_length(self) -> None:
        """transformers' dynamic RoPE keeps the frequencies of the longest sequence it has seen
        until one shorter than max_position_embeddings comes. A training step must depend on its
        own batch only (and a resumed run not on where it resumed), so every forward starts from
        the checkpoint's frequencies, as a freshly loaded model does and the native model computes."""
        for module in self.hf.modules():
            if getattr(module, "rope_type", None) != "dynamic":
                continue
            if module.max_seq_len_cached != module.original_max_seq_len:
                module.inv_freq = module.original_inv_freq.clone()
                module.max_seq_len_cached = module.original_max_seq_len

