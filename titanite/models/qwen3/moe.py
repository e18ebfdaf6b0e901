"""Qwen3 mixture of experts: router -> dispatch (permute -> experts -> unpermute).

Three separate, swappable units, each a module that calls one kernel op:

- `TopKRouter` (`moe.router`): softmax over the experts and top-k, in fp32, optionally steered
  by a per-expert balancing bias that picks experts but never weights them; the chosen
  probabilities are renormalised when `norm_topk_prob`.
- `TokenDispatcher` (`moe.dispatch`): dropless token-choice dispatch: the (token, slot) pairs
  are sorted by expert, the experts run on the sorted rows with per-expert counts, and each
  token's k outputs are put back in order and summed with the routing weights.
- `GroupedExperts` (`moe.experts`): every expert's SwiGLU at once on expert-sorted rows, from
  stacked weights laid out like transformers' in-memory ones: w_gate_up [E, 2I, H] (gate rows,
  then up rows) and w_down [E, H, I]. The default implementation is torch._grouped_mm (no
  Python loop over experts); the reference is a plain per-expert loop.

Expert parallelism goes between dispatch and experts: it wraps `GroupedExperts`, which gets
(rows sorted by global expert [N, H], counts per global expert [E]), moves each rank's rows to
it, runs the local experts with local counts and sends the outputs back. Router and
dispatcher are unchanged by it.

Shapes: T tokens (B * S), H hidden, E experts, k experts per token, I expert intermediate size,
N = T * k routed rows.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from titanite import kernels
from titanite.core.errors import UserError
from titanite.kernels.routing import RoutingRecord, expert_counts


class TopKRouter(nn.Module):
    """gate.weight [E, H]. `expert_bias` [E] fp32 is the auxiliary-loss-free balancing bias: a
    persistent buffer (saved in training checkpoints; not part of the Hugging Face layout) that
    stays zero unless `model.moe_bias_update_rate` > 0. A zero bias leaves the choice exactly as
    without one. `tokens_per_expert` [E] int64 counts routed rows between bias updates."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise UserError(f"num_experts_per_tok ({top_k}) must be between 1 and num_experts ({num_experts})")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        # int64, so model.to(bfloat16) leaves the counts exact.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.kernel = kernels.op("moe.router")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (probs fp32 [T, E], topk_weights fp32 [T, k], topk_ids int64 [T, k])."""
        # Routing in fp32 even under bf16 autocast or bf16 weights: in bf16 near-tied experts flip.
        with torch.autocast(x.device.type, enabled=False):
            return self.kernel(x.float(), self.gate.weight.float(), self.top_k, self.norm_topk_prob,
                               self.expert_bias.float())

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the token counter (after meta-device init). The persistent bias is left alone:
        it comes from init_weights, a checkpoint, or a Hugging Face load (zero)."""
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        """One auxiliary-loss-free balancing step. counts: [E] rows routed per expert since the
        last update (over all ranks). Experts above the mean load move down by `rate`, those
        below move up; the step is centred so the bias keeps a zero mean (only differences
        between experts change the choice)."""
        counts = counts.float()
        step = torch.sign(counts.mean() - counts)
        self.expert_bias.add_(rate * (step - step.mean()))


class TokenDispatcher(nn.Module):
    """Dropless token-choice dispatch around an experts callable (see `moe.dispatch`)."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.kernel = kernels.op("moe.dispatch")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: nn.Module) -> torch.Tensor:
        """x: [T, H]; topk_ids int64 [T, k]; topk_weights fp32 [T, k];
        experts(rows [N, H] sorted by expert, counts int64 [E]) -> [N, H]. Returns [T, H]."""
        return self.kernel(x, topk_ids, topk_weights, self.num_experts, experts)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.kernel = kernels.op("moe.experts")

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, H] rows sorted by expert, counts: int64 [E] rows per expert -> [N, H]."""
        return self.kernel(x, counts, self.w_gate_up, self.w_down)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.w_gate_up, mean=0.0, std=std)
        nn.init.normal_(self.w_down, mean=0.0, std=std)


class MoE(nn.Module):
    """Sparse MoE block. After each forward `last_routing` holds this layer's RoutingRecord, which
    the model handle turns into the auxiliary loss and telemetry.

    Qwen3-MoE has routed experts only. Qwen3.5-MoE and Qwen3-Next add `shared_expert` (a SwiGLU
    MLP every token passes through), scaled per token by sigmoid(shared_expert_gate(x)), with
    shared_expert_gate.weight [1, H]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(hidden, num_experts, top_k, norm_topk_prob)
        self.dispatcher = TokenDispatcher(num_experts)
        self.experts = GroupedExperts(num_experts, hidden, intermediate)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None else nn.Linear(hidden, 1, bias=False)
        self.last_routing: RoutingRecord | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, H] -> [B, S, H] (same dtype)."""
        tokens = x.reshape(-1, x.shape[-1])  # [T, H]
        probs, topk_weights, topk_ids = self.router(tokens)
        out = self.dispatcher(tokens, topk_ids, topk_weights, self.experts).to(x.dtype)
        with torch.no_grad():
            counts = expert_counts(topk_ids, self.num_experts)
        self.last_routing = RoutingRecord(counts, probs.sum(dim=0), tokens.shape[0])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.view(x.shape)


# -- finding the MoE layers of a built model ---------------------------------------------

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(layer index, MoE) for every MoE block, found by name so that wrappers in the module path
    (activation checkpointing, compile, FSDP) do not hide them."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            m = _LAYER_INDEX.search(f".{name}.")
            assert m, f"MoE module {name} is not inside layers.N"
            found.append((int(m.group(1)), module))
    return found
