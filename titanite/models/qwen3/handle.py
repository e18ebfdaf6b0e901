"""The native backend (`model.spec = "qwen3"`): titanite's own Qwen3, Qwen3-MoE, Qwen3.5 and
Qwen3-Next in a handle.

The architecture comes from `model.hf_path`'s config.json when set, else from a named flavor.
Checkpoints go in and out in the Hub's layout through `Qwen3StateDictAdapter` (the hybrid
families: `HybridStateDictAdapter`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from titanite.core.config import KernelsConfig, LoraConfig, ModelConfig
from titanite.core.errors import UserError
from titanite.formats.safetensors_io import read_hf_config
from titanite.formats.sharded import RandomSource, RegionGather, gather_whole, local_regions
from titanite.models.handle import ActivationProfile, AllReduce, ModelHandle, ModelOptions, TrainOutput
from titanite.models.lora import LoraTarget, delta, scale
from titanite.models.moe_stats import load_balancing_loss, pooled, routing_stats
from titanite.models.qwen3.args import Qwen3Args, from_hf_config, to_hf_config, with_rope_scaling
from titanite.models.qwen3.flavors import get_flavor
from titanite.models.qwen3.hybrid_args import merge_into_source
from titanite.models.qwen3.hybrid_state_dict import HybridRandomSource, HybridStateDictAdapter
from titanite.models.qwen3.model import Qwen3
from titanite.models.qwen3.moe import moe_layers
from titanite.models.qwen3.state_dict import Qwen3StateDictAdapter

log = logging.getLogger("titanite")


def resolve_args(cfg: ModelConfig) -> tuple[Qwen3Args, dict[str, Any] | None]:
    """(architecture, the config.json it came from or None): config.json decides when hf_path is
    set; otherwise the flavor does. `model.rope_scaling` replaces either's RoPE scaling."""
    if cfg.hf_path:
        source = read_hf_config(cfg.hf_path)
        args = from_hf_config(source, where=f"{cfg.hf_path}/config.json")
    else:
        args, source = get_flavor(cfg.flavor), None
    return with_rope_scaling(args, cfg.rope_scaling), source


def build(cfg: ModelConfig) -> Qwen3Model:
    """The native model on the meta device."""
    args, source = resolve_args(cfg)
    if cfg.moe_bias_update_rate and not args.is_moe:
        raise UserError(f"config key 'model.moe_bias_update_rate' is {cfg.moe_bias_update_rate} but the model "
                        f"is dense (no num_experts): there is no routing to balance; set it to 0")
    with torch.device("meta"):
        module = Qwen3(args)
    return Qwen3Model(module, args, source, cfg.hf_path, ModelOptions(cfg.moe_bias_update_rate))


class Qwen3Model(ModelHandle):
    backend = "qwen3"
    supports_document_masks = True
    supports_expert_parallel = True
    supports_generation = True  # hybrid layers too: kv_cache.py keeps their conv window and state
    fused_loss = True
    module: Qwen3
    pipeline_modules = ("layers", ("tok_embeddings",), ("norm", "output"))

    def routing(self, layers: range) -> list[tuple[int, Any]]:
        return [(i, m.last_routing) for i, m in moe_layers(self.module) if i in layers]

    def hf_config(self) -> dict[str, Any]:
        # Start from the checkpoint's own config.json so fields titanite does not model survive.
        if self.args.is_hybrid:  # also inside text_config (multimodal) and rope_parameters (MRoPE)
            return merge_into_source(self.source_config or {}, to_hf_config(self.args))
        base = dict(self.source_config or {})
        base.update(to_hf_config(self.args))
        return base

    def activation_profile(self, kernels_cfg: KernelsConfig, tp: int) -> ActivationProfile:
        return ActivationProfile(sequence_parallel=True, keeps_logits=self.keeps_logits(kernels_cfg, tp))

    def state_dict_adapter(self) -> Qwen3StateDictAdapter:
        return HybridStateDictAdapter(self.args) if self.args.is_hybrid else Qwen3StateDictAdapter(self.args)

    def random_source(self, seed: int, std: float) -> RandomSource:
        return HybridRandomSource(seed, std) if self.args.is_hybrid else RandomSource(seed, std)

    def hf_state_dict(self, regions: RegionGather | None = None,
                      merged: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        if any(not m.router.expert_bias.is_meta and bool(m.router.expert_bias.any())  # meta: titanite export checks
               for _, m in moe_layers(self.module)):
            log.warning("the MoE routing bias (model.moe_bias_update_rate) is not part of the Hugging Face "
                        "layout and is left out of the export: transformers will route without it")
        hf_merged = {f"{t.key}.weight": t for t in self.lora.targets if t.merge_in_hf} if merged and self.lora else {}
        for key, tensor in super().hf_state_dict(regions, merged):
            t = hf_merged.get(key)
            if t is not None:  # a Gated DeltaNet adapter: B @ A is exactly this tensor's update (lora/native.py)
                a, b = self._full_factors(t, functools.partial(gather_whole, regions or local_regions, t.a))
                tensor = (tensor.float() + delta(t, a, b, scale(self.lora.cfg))).to(tensor.dtype)
            yield key, tensor

    def _inject_lora(self, cfg: LoraConfig) -> list[LoraTarget]:
        from titanite.models.lora import native

        return native.apply(self.module, cfg)

    def init_buffers(self) -> None:
        self.module.init_buffers()

    def forward_train(self, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """MoE models add: the auxiliary load-balancing loss x router_aux_loss_coef, only when
        config.json's output_router_logits is on (as transformers does), and expert-load stats
        (see moe_stats.routing_stats). Routed-token counts accumulate for the balancing bias, in
        training forwards only (not under no_grad: evaluation, a DPO reference's forward).

        The cross-entropy comes from the model's `loss` op (no [B, S, V] logits), except when
        loss_from_logits (a vocabulary-sharded head)."""
        fused = not self.loss_from_logits
        out = self.module(batch["input_ids"], position_ids=batch["position_ids"],
                          document_ids=batch.get("document_ids"), labels=batch["labels"] if fused else None)
        logits, loss_sum = (None, out) if fused else (out, None)
        layers = moe_layers(self.module)
        if not layers:
            return TrainOutput(logits, loss_sum=loss_sum)
        arch = self.args
        records = pooled([(i, m.last_routing) for i, m in layers])
        balance = load_balancing_loss([r for _, r in records], arch.num_experts)
        if self.options.moe_bias_update_rate and torch.is_grad_enabled():  # not evaluation's or a reference's
            with torch.no_grad():
                for (_, m), (_, r) in zip(layers, records):
                    m.router.tokens_per_expert += r.counts
        aux = arch.router_aux_loss_coef * balance if arch.output_router_logits else None
        return TrainOutput(logits, aux, routing_stats(records, balance), loss_sum=loss_sum,
                           routing=[r for _, r in records])

    @torch.no_grad()
    def after_optimizer_step(self, all_reduce: AllReduce) -> None:
        """Auxiliary-loss-free balancing: update every router's bias from the tokens it routed
        during the step, summed over all ranks (every rank then applies the same update)."""
        rate = self.options.moe_bias_update_rate
        routers = [m.router for _, m in moe_layers(self.module)]
        if not rate or not routers:
            return
        counts = all_reduce(torch.stack([r.tokens_per_expert for r in routers]))  # [L, E]
        for router, c in zip(routers, counts):
            router.update_bias(c, rate)
            router.tokens_per_expert.zero_()
