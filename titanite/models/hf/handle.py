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

In training, `attach_kernels` then routes all eight kernel ops through titanite's call sites
(titanite/kernels/hf.py), bound from `[kernels]` like the native model's: the loss comes from
the hidden states and the head weight (no logits with the chunked loss), and the MoE routing and
auxiliary loss from the `moe.router` op, as in the native model. The two choices above run
wherever no kernels are attached, e.g. in `titanite.load_pretrained(path, spec="hf")`.

Weights are loaded by titanite's own safetensors reader, tensor by tensor into the
materialised model, through `HFStateDictAdapter` (per-expert keys on disk, fused in memory).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from titanite.core.config import KernelsConfig, LoraConfig, ModelConfig
from titanite.core.errors import UserError
from titanite.models.handle import ActivationProfile, ModelHandle, TrainOutput
from titanite.models.hf import config as hf_config
from titanite.models.hf.model import HFCausalLM
from titanite.models.hf.state_dict import HEAD, PREFIX, HFStateDictAdapter
from titanite.models.lora import LoraTarget
from titanite.models.moe_stats import load_balancing_loss, pooled, routing_stats
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
    supports_expert_parallel = True  # through the experts interface (parallel/expert_parallel.py)
    fused_loss = True  # the head's `loss` call site (kernels/hf.py)
    module: HFCausalLM
    _installed: dict[str, int] | None = None  # titanite's call sites, per module kind (kernels/hf.py)
    pipeline_modules = ("hf.model.layers", ("hf.model.embed_tokens",), ("hf.model.norm", "hf.lm_head"))

    def routing(self, layers: range) -> list[tuple[int, Any]]:
        blocks = self.module.hf.model.layers
        return [(i, blocks[i].mlp.gate.last_routing) for i in layers if self.args.layer_is_moe(i)]

    def hf_config(self) -> dict[str, Any]:
        # The checkpoint's own config.json, untouched except for the dtype the export is in.
        base = dict(self.source_config) if self.source_config else to_hf_config(self.args)
        base.pop("torch_dtype", None)  # the pre-5.0 name of `dtype`
        base["dtype"] = str(next(self.module.parameters()).dtype).removeprefix("torch.")
        return base

    def activation_profile(self, kernels_cfg: KernelsConfig, tp: int) -> ActivationProfile:
        # The tensor-parallel plan keeps the residual stream whole (parallel/hf.py).
        return ActivationProfile(sequence_parallel=False, keeps_logits=self.keeps_logits(kernels_cfg, tp))

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

    def _inject_lora(self, cfg: LoraConfig) -> list[LoraTarget]:
        from titanite.models.lora import hf as lora_hf

        self.module.tie()
        return lora_hf.apply(self.module, cfg)

    def init_buffers(self) -> None:
        self.module.init_buffers()

    def attach_kernels(self, kernels_cfg: KernelsConfig, device_type: str, dtype: torch.dtype) -> dict[str, str]:
        """Give transformers' modules titanite's call sites for all eight ops (kernels/hf.py),
        then bind them from `[kernels]` like the native model's. FQN globs match either the
        transformers names or the native model's names for the same modules."""
        from titanite.kernels import attach
        from titanite.kernels.hf import native_name

        self._install()
        return attach(self.module, kernels_cfg.select, device_type, dtype, kernels_cfg.fallback, alias=native_name)

    def _install(self) -> None:
        from titanite.kernels.hf import install

        self._installed = install(self.module.hf)
        if not self._installed["head"]:  # fused_loss relies on the head's `loss` call site
            raise RuntimeError(f"{type(self.module.hf).__name__}: the output head is not a bias-free "
                               "nn.Linear, so titanite's loss call site cannot be installed")

    def forward_train(self, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """As the native model's: the cross-entropy from the `loss` op on the hidden states
        unless the head is vocabulary-sharded; for MoE models the load-balancing loss (x
        router_aux_loss_coef, only when config.json's output_router_logits is on) and the
        expert-load stats from what each `moe.router` call recorded."""
        if self._installed is None:  # not attached: every call site runs its op's default
            self._install()
        arch = self.args
        fused = not self.loss_from_logits
        out = self.module.run(batch["input_ids"], batch["position_ids"], batch.get("document_ids"),
                              labels=batch["labels"] if fused else None)
        logits, loss_sum = (None, out.logits) if fused else (out.logits, None)
        if not arch.is_moe:
            return TrainOutput(logits, loss_sum=loss_sum)
        records = pooled([(i, layer.mlp.gate.last_routing) for i, layer in enumerate(self.module.hf.model.layers)
                          if arch.layer_is_moe(i)])
        balance = load_balancing_loss([r for _, r in records], arch.num_experts)
        aux = arch.router_aux_loss_coef * balance if arch.output_router_logits else None
        return TrainOutput(logits, aux, routing_stats(records, balance), loss_sum=loss_sum,
                           routing=[r for _, r in records])
