"""ModelSpec for the native Qwen3 (dense and MoE)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanite.checkpoint.hf_weights import load_with_adapter
from titanite.checkpoint.safetensors_io import read_hf_config
from titanite.config import ModelConfig
from titanite.errors import UserError
from titanite.models.qwen3.args import Qwen3Args, from_hf_config, to_hf_config
from titanite.models.qwen3.flavors import get_flavor
from titanite.models.qwen3.model import Qwen3
from titanite.models.qwen3.moe import load_balancing_loss, moe_layers, routing_stats
from titanite.models.qwen3.state_dict import Qwen3StateDictAdapter
from titanite.models.spec import ModelSpec, TrainOutput, register_spec
from titanite.parallel.distributed import full_tensor

log = logging.getLogger("titanite")


def resolve_args(cfg: ModelConfig) -> Qwen3Args:
    """config.json decides the architecture when hf_path is set; otherwise the flavor does."""
    if cfg.hf_path:
        return from_hf_config(read_hf_config(cfg.hf_path), where=f"{cfg.hf_path}/config.json")
    return get_flavor(cfg.flavor)


class Qwen3Spec(ModelSpec):
    name = "qwen3"
    supports_document_masks = True

    def build(self, cfg: ModelConfig) -> nn.Module:
        args = resolve_args(cfg)
        with torch.device("meta"):
            model = Qwen3(args)
        model.source_hf_config = read_hf_config(cfg.hf_path) if cfg.hf_path else None
        if cfg.moe_bias_update_rate and not args.is_moe:
            raise UserError(f"config key 'model.moe_bias_update_rate' is {cfg.moe_bias_update_rate} but the model "
                            f"is dense (no num_experts): there is no routing to balance; set it to 0")
        model.moe_bias_update_rate = cfg.moe_bias_update_rate
        return model

    def hf_config(self, model: nn.Module) -> dict[str, Any]:
        # Start from the checkpoint's own config.json so fields titanite does not model survive.
        base = dict(model.source_hf_config or {})
        base.update(to_hf_config(model.args))
        return base

    def init_weights(self, model: nn.Module, std: float) -> None:
        model.init_weights(std)

    def init_buffers(self, model: nn.Module) -> None:
        model.init_buffers()

    def state_dict_adapter(self, model: nn.Module) -> Qwen3StateDictAdapter:
        return Qwen3StateDictAdapter(model.args)

    def load_hf(self, model: nn.Module, folder: str) -> None:
        load_with_adapter(model, self.state_dict_adapter(model), folder)
        model.init_buffers()

    def hf_state_dict(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        adapter = self.state_dict_adapter(model)
        if any(bool(m.router.expert_bias.any()) for _, m in moe_layers(model)):
            log.warning("the MoE routing bias (model.moe_bias_update_rate) is not part of the Hugging Face "
                        "layout and is left out of the export: transformers will route without it")
        for name, tensor in model.state_dict().items():
            # Gathered before the adapter splits stacked experts; every rank walks the same keys,
            # so the collectives line up.
            yield from adapter.to_hf(name, full_tensor(tensor))

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        return flops_per_token(model.args, seq_len)

    def forward_train(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> TrainOutput:
        """MoE models add: the auxiliary load-balancing loss x router_aux_loss_coef, only when
        config.json's output_router_logits is on (as transformers does), and expert-load stats
        (see moe.routing_stats). Routed-token counts accumulate for the balancing bias.

        The cross-entropy comes from the model's `loss` op (no [B, S, V] logits), except under
        tensor parallelism, where the head is vocabulary-sharded and the trainer computes it
        from the sharded logits (loss_parallel)."""
        fused = not getattr(model, "loss_from_logits", False)
        out = model(batch["input_ids"], position_ids=batch["position_ids"],
                    document_ids=batch.get("document_ids"), labels=batch["labels"] if fused else None)
        logits, loss_sum = (None, out) if fused else (out, None)
        layers = moe_layers(model)
        if not layers:
            return TrainOutput(logits, loss_sum=loss_sum)
        a = model.args
        records = [(i, m.last_routing) for i, m in layers]
        balance = load_balancing_loss([r for _, r in records], a.num_experts)
        if model.moe_bias_update_rate:
            with torch.no_grad():
                for (_, m), (_, r) in zip(layers, records):
                    m.router.tokens_per_expert += r.counts
        aux = a.router_aux_loss_coef * balance if a.output_router_logits else None
        return TrainOutput(logits, aux, routing_stats(records, balance), loss_sum=loss_sum)

    @torch.no_grad()
    def after_optimizer_step(self, model: nn.Module) -> None:
        """Auxiliary-loss-free balancing: update every router's bias from the tokens it routed
        during the step, summed over all ranks (every rank then applies the same update)."""
        rate = getattr(model, "moe_bias_update_rate", 0.0)
        routers = [m.router for _, m in moe_layers(model)]
        if not rate or not routers:
            return
        counts = torch.stack([r.tokens_per_expert for r in routers])  # [L, E]
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        for router, c in zip(routers, counts):
            router.update_bias(c, rate)
            router.tokens_per_expert.zero_()

    def parallelize(self, model: nn.Module, world: Any, cfg: Any) -> nn.Module:
        from titanite.parallel.qwen3 import parallelize_qwen3

        model = parallelize_qwen3(model, world, cfg)
        # The loss op needs the whole head matrix; a vocabulary-sharded (tensor-parallel) head
        # gives sharded logits, whose cross-entropy the trainer computes across the shards.
        model.loss_from_logits = world.tp > 1
        return model


def flops_per_token(a: Qwen3Args, seq_len: int) -> float:
    """6 x (parameters a token passes through, head included) + attention scores and values.

    Attention: per layer and token, QK^T and AV are 2 * 2 * S * Hq * D forward FLOPs for the
    full (non-causal) square; x3 for backward. The causal half is not discounted, as is usual.
    """
    attn_proj = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    dense_mlp = 3 * a.hidden_size * a.intermediate_size
    active_mlp = 3 * a.hidden_size * a.moe_intermediate_size * a.num_experts_per_tok + a.hidden_size * a.num_experts
    matmul_params = a.hidden_size * a.vocab_size  # output head
    for i in range(a.num_layers):
        matmul_params += attn_proj + (active_mlp if a.layer_is_moe(i) else dense_mlp)
    attention = 12 * a.num_layers * a.num_heads * a.head_dim * seq_len
    return 6 * matmul_params + attention


register_spec(Qwen3Spec())
