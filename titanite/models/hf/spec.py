"""ModelSpec `hf`: Qwen3 / Qwen3-MoE through transformers' AutoModelForCausalLM.

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

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from titanite.checkpoint.hf_weights import load_with_adapter
from titanite.config import ModelConfig
from titanite.errors import UserError
from titanite.models.hf import config as hf_config
from titanite.models.hf.model import HFCausalLM
from titanite.models.hf.state_dict import HEAD, PREFIX, HFStateDictAdapter
from titanite.models.qwen3.args import to_hf_config
from titanite.models.qwen3.moe import RoutingRecord, expert_counts, routing_stats
from titanite.models.qwen3.spec import flops_per_token
from titanite.models.spec import ModelSpec, TrainOutput, register_spec
from titanite.parallel.distributed import full_tensor

ATTN_IMPLEMENTATION = "sdpa"
EXPERTS_IMPLEMENTATION = "grouped_mm"


class HFSpec(ModelSpec):
    name = "hf"
    supports_document_masks = True  # document_ids become a block-causal attention mask

    def build(self, cfg: ModelConfig) -> nn.Module:
        if cfg.moe_bias_update_rate:
            raise UserError(f"config key 'model.moe_bias_update_rate' ({cfg.moe_bias_update_rate}) balances the "
                            "native MoE router; transformers' router has no bias. Use model.spec = 'qwen3' "
                            "or set it to 0")
        config, args, source = hf_config.resolve(cfg)
        kw: dict[str, Any] = {"attn_implementation": ATTN_IMPLEMENTATION}
        if args.is_moe:
            kw["experts_implementation"] = EXPERTS_IMPLEMENTATION
        # fp32 parameters: mixed precision is the trainer's autocast, whatever dtype
        # config.json records for the published weights.
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code,
                                                  dtype=torch.float32, **kw)
        model = HFCausalLM(hf, args)
        model.source_hf_config = source
        return model

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        # The checkpoint's own config.json, untouched except for the dtype the export is in.
        base = dict(model.source_hf_config) if model.source_hf_config else to_hf_config(model.args)
        base.pop("torch_dtype", None)  # the pre-5.0 name of `dtype`
        base["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        return base

    def init_weights(self, model: nn.Module, std: float) -> None:
        model.init_weights(std)

    def init_buffers(self, model: nn.Module) -> None:
        model.init_buffers()

    def state_dict_adapter(self, model: nn.Module) -> HFStateDictAdapter:
        return HFStateDictAdapter(model.args.tie_word_embeddings)

    def load_hf(self, model: nn.Module, folder: str) -> None:
        model.tie()
        load_with_adapter(model, self.state_dict_adapter(model), folder)
        model.init_buffers()

    def check_hf(self, model: nn.Module, folder: str) -> None:
        model.tie()  # the tied head is one tensor, as load_hf sees it
        super().check_hf(model, folder)

    def hf_state_dict(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        adapter = self.state_dict_adapter(model)
        for name, tensor in model.state_dict().items():
            if adapter.tied and name == PREFIX + HEAD:
                continue  # the embedding, already written under its own key
            # Gathered before the split: per-expert slices of an FSDP-sharded fused tensor would
            # cut across ranks. Every rank walks the same keys, so the collectives line up.
            yield from adapter.to_hf(name, full_tensor(tensor))

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        return flops_per_token(model.args, seq_len)

    def attach_kernels(self, model: nn.Module, cfg: Any, device_type: str, dtype: torch.dtype) -> dict[str, str]:
        """titanite's `attention`, `moe.dispatch` and `moe.experts` ops replace transformers'
        attention and experts implementations (see titanite/kernels/hf.py), bound from
        `[kernels]` like the native model's; the other ops have no seam in transformers."""
        from titanite.kernels.hf import install

        install(model.hf)
        return super().attach_kernels(model, cfg, device_type, dtype)

    def parallelize(self, model: nn.Module, world: Any, cfg: Any) -> nn.Module:
        from titanite.models.hf.parallel import parallelize_hf

        return parallelize_hf(model, world, cfg)

    def forward_train(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """MoE models add what the native backend adds, from transformers' router logits: the
        load-balancing loss (transformers' own `aux_loss`) x router_aux_loss_coef, only when
        config.json's output_router_logits is on, and the expert-load stats (moe.routing_stats),
        always."""
        a = model.args
        out = model.run(batch["input_ids"], batch["position_ids"], batch.get("document_ids"),
                        output_router_logits=a.is_moe)
        if not a.is_moe:
            return TrainOutput(out.logits)
        sparse = [i for i in range(a.num_layers) if a.layer_is_moe(i)]
        records = [(i, routing_record(logits, a.num_experts_per_tok))
                   for i, logits in zip(sparse, out.router_logits, strict=True)]
        aux = a.router_aux_loss_coef * out.aux_loss if a.output_router_logits else None
        return TrainOutput(out.logits, aux, routing_stats(records, out.aux_loss))


@torch.no_grad()
def routing_record(router_logits: torch.Tensor, top_k: int) -> RoutingRecord:
    """One MoE layer's routing from its router logits [T, E], chosen as transformers' router
    chooses (softmax in fp32, top-k). For telemetry only: no gradient."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_ids = torch.topk(probs, top_k, dim=-1).indices
    return RoutingRecord(expert_counts(topk_ids, probs.shape[-1]), probs.sum(0), probs.shape[0])


register_spec(HFSpec())
