"""The Transformers backend (`model.spec = "hf"`): Qwen3 / Qwen3-MoE through transformers'
AutoModelForCausalLM, in a handle.

The architecture comes from `model.hf_path`'s config.json (or a named flavor, translated to the
equivalent transformers config). The model is built on the meta device with the attention and
MoE-experts implementations chosen here, not left to transformers' defaults:

- attention: `sdpa`. It runs forward and backward on every PyTorch device; flex_attention has
  no CPU backward, and flash-attention needs a separate package and a CUDA device.
- experts: `grouped_mm` (torch._grouped_mm over the fused expert weights). It runs on CPU and
  accelerators in fp32 and bf16; transformers' `eager` loops over experts in Python (15x
  slower on CPU with 64 experts, top-8) and `batched_mm` gathers a weight copy per token.

In training, `attach_kernels` then routes attention and the experts through titanite's kernel
ops, bound from `[kernels]` like the native model's (titanite/kernels/hf.py). The two choices
above run wherever no kernels are attached, e.g. in `titanite.load_pretrained(path, spec="hf")`.

Weights are loaded by titanite's own safetensors reader, tensor by tensor into the
materialised model, through `HFStateDictAdapter` (per-expert keys on disk, fused in memory).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from titanite.config import KernelsConfig, ModelConfig
from titanite.errors import UserError
from titanite.models.handle import ActivationProfile, ModelHandle, TrainOutput
from titanite.models.hf import config as hf_config
from titanite.models.hf.model import HFCausalLM
from titanite.models.hf.state_dict import HEAD, PREFIX, HFStateDictAdapter
from titanite.models.moe_stats import record_from_logits, routing_stats
from titanite.models.qwen3.args import to_hf_config

ATTN_IMPLEMENTATION = "sdpa"
EXPERTS_IMPLEMENTATION = "grouped_mm"


def build(cfg: ModelConfig) -> HFModel:
    """The transformers model on the meta device, pinned to config.json's math."""
    if cfg.moe_bias_update_rate:
        raise UserError(f"config key 'model.moe_bias_update_rate' ({cfg.moe_bias_update_rate}) balances the "
                        "native MoE router; transformers' router has no bias. Use model.spec = 'qwen3' "
                        "or set it to 0")
    config, args, source = hf_config.resolve(cfg)
    kw: dict[str, Any] = {"attn_implementation": ATTN_IMPLEMENTATION}
    if args.is_moe:
        kw["experts_implementation"] = EXPERTS_IMPLEMENTATION
    # fp32 parameters: mixed precision is the trainer's autocast, whatever dtype config.json
    # records for the published weights.
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code,
                                              dtype=torch.float32, **kw)
    return HFModel(HFCausalLM(hf, args), args, source, cfg.hf_path)


class HFModel(ModelHandle):
    backend = "hf"
    supports_document_masks = True  # document_ids become a block-causal attention mask
    module: HFCausalLM

    def hf_config(self) -> dict[str, Any]:
        # The checkpoint's own config.json, untouched except for the dtype the export is in.
        base = dict(self.source_config) if self.source_config else to_hf_config(self.args)
        base.pop("torch_dtype", None)  # the pre-5.0 name of `dtype`
        base["dtype"] = str(next(self.module.parameters()).dtype).removeprefix("torch.")
        return base

    def activation_profile(self, kernels_cfg: KernelsConfig, tp: int) -> ActivationProfile:
        # transformers' head returns the logits; its tensor-parallel plan keeps the residual
        # stream whole (parallel/hf.py).
        return ActivationProfile(sequence_parallel=False, keeps_logits=True)

    def state_dict_adapter(self) -> HFStateDictAdapter:
        return HFStateDictAdapter(self.args.tie_word_embeddings)

    def check_hf(self, folder: str) -> None:
        self.module.tie()  # the tied head is one tensor, as load_hf sees it
        super().check_hf(folder)

    def load_hf(self, folder: str) -> None:
        self.module.tie()
        super().load_hf(folder)

    def is_alias(self, name: str) -> bool:
        return self.args.tie_word_embeddings and name == PREFIX + HEAD  # the embedding, written once

    def init_weights(self, std: float) -> None:
        self.module.init_weights(std)

    def init_buffers(self) -> None:
        self.module.init_buffers()

    def attach_kernels(self, kernels_cfg: KernelsConfig, device_type: str, dtype: torch.dtype) -> dict[str, str]:
        """titanite's `attention`, `moe.dispatch` and `moe.experts` ops replace transformers'
        attention and experts implementations (see titanite/kernels/hf.py), bound from
        `[kernels]` like the native model's; the other ops have no seam in transformers."""
        from titanite.kernels.hf import install

        install(self.module.hf)
        return super().attach_kernels(kernels_cfg, device_type, dtype)

    def forward_train(self, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """MoE models add what the native backend adds, from transformers' router logits: the
        load-balancing loss (transformers' own `aux_loss`) x router_aux_loss_coef, only when
        config.json's output_router_logits is on, and the expert-load stats, always."""
        a = self.args
        out = self.module.run(batch["input_ids"], batch["position_ids"], batch.get("document_ids"),
                              output_router_logits=a.is_moe)
        if not a.is_moe:
            return TrainOutput(out.logits)
        sparse = [i for i in range(a.num_layers) if a.layer_is_moe(i)]
        records = [(i, record_from_logits(logits, a.num_experts_per_tok))
                   for i, logits in zip(sparse, out.router_logits, strict=True)]
        aux = a.router_aux_loss_coef * out.aux_loss if a.output_router_logits else None
        return TrainOutput(out.logits, aux, routing_stats(records, out.aux_loss))
