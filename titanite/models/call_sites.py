"""`titanite kernels verify --spec SPEC`: every implementation through a model's own call sites.

`titanite kernels verify` checks an implementation on the op's inputs. This checks it where a
training run calls it: a small Qwen3-MoE with a dense layer (every op has call sites in it) is
built by the backend `SPEC` (`hf`: transformers' modules with titanite's call sites installed;
`qwen3`: the native model), the implementation is bound at every call site of its op, every
other op runs its reference, and one training forward (packed documents, labels, the MoE
auxiliary loss) and its backward run. The oracle is the same model with references everywhere
in float64. Errors are norm-wise: |loss - oracle| / |oracle| and, over all parameter gradients
together, ||grad - oracle|| / ||oracle||. The implementation passes when both are within twice
the error of the all-reference model in the same dtype, or the dtype floor (the rule of
`kernels verify`). bf16 / fp16 run as training runs them: autocast over fp32 weights.

It lives in the model layer because it builds and drives models (`get_spec`, the handle); the
kernels command (`kernels/cli.py`) receives it from `titanite.cli`, so the kernel layer imports
nothing of `titanite.models`.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import titanite.kernels.registry as registry
from titanite.core.config import KernelsConfig, ModelConfig
from titanite.kernels.verify import FLOORS, Row, _oracle_dtype, selected, skip_row
from titanite.models.spec import get_spec

# Every op has call sites here: layers 0 and 2 sparse (router, dispatch, experts), layer 1
# dense (swiglu); untied head (the loss op on its own module).
_ARCH = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
             output_router_logits=True, router_aux_loss_coef=0.01, rope_theta=10000.0, rms_norm_eps=1e-6,
             architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu")


def _batch(device: torch.device) -> dict[str, torch.Tensor]:
    """Two rows of packed documents, positions restarting per document, some labels ignored."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, _ARCH["vocab_size"], (2, 24), generator=gen)
    docs = torch.tensor([[0] * 9 + [1] * 15, [0] * 3 + [1] * 4 + [2] * 17])
    pos = torch.cat([torch.arange(n) for n in (9, 15, 3, 4, 17)]).view(2, 24)
    labels = torch.roll(ids, -1, dims=1)
    labels[docs != torch.roll(docs, -1, dims=1)] = -100  # no label across a document boundary
    labels[:, -1] = -100
    return {k: v.to(device) for k, v in dict(input_ids=ids, position_ids=pos, document_ids=docs, labels=labels).items()}


class _Model:
    """One model of the backend, rebuilt per run from the same fp32 weights."""

    def __init__(self, spec: str, device: torch.device) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="titanite-call-sites-")
        Path(self._folder.name, "config.json").write_text(json.dumps(_ARCH))
        self.spec, self.device = spec, device
        self._build = lambda: get_spec(spec).build(ModelConfig(spec=spec, hf_path=self._folder.name, init="random"))
        handle = self._build()
        handle.module.to_empty(device=device)
        handle.init_weights(0.2, seed=0)  # large enough that every op's error shows in the loss
        self.weights = {k: v.detach().clone() for k, v in handle.module.state_dict().items()}

    def run(self, select: dict[str, str], dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """([loss], parameter grads) of one training forward + backward, computed in `dtype` as a
        run computes: fp32 and float64 weights as they are; bf16 / fp16 as autocast over fp32
        weights (`training.mixed_precision`)."""
        handle = self._build()
        module = handle.module
        module.to_empty(device=self.device)
        module.load_state_dict(self.weights)
        autocast = dtype in (torch.bfloat16, torch.float16)
        module.to(torch.float32 if autocast else dtype)
        handle.init_buffers()
        quiet = logging.getLogger("titanite")
        level = quiet.level
        quiet.setLevel(logging.WARNING)  # the bindings are not news here (setLevel clears the cache)
        try:
            handle.attach_kernels(KernelsConfig(select=select), self.device.type, dtype)
        finally:
            quiet.setLevel(level)
        with torch.autocast(self.device.type, dtype=dtype, enabled=autocast):
            batch = _batch(self.device)
            out = handle.forward_train(batch)
        loss = out.loss_sum / (batch["labels"] != -100).sum() + out.aux_loss  # the mean, as training
        loss.backward()
        params = [p for _, p in sorted(module.named_parameters())]
        return [loss.detach()], [p.grad for p in params]


def _rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all tensors together: the error of the whole gradient (or
    the loss), so a small tensor's rounding does not dominate as it would per tensor."""
    diff = torch.cat([(a.double() - b.double()).flatten() for a, b in zip(got, want, strict=True)])
    ref = torch.cat([b.double().flatten() for b in want])
    return (diff.norm() / ref.norm().clamp_min(1e-30)).item()


def verify_call_sites(spec: str, ops: list[str] | None = None, impl: str | None = None,
                      device: torch.device | str = "cpu", dtypes: list[torch.dtype] | None = None,
                      progress: Callable[[Row], None] | None = None) -> list[Row]:
    """One Row per (op, implementation, dtype), as `verify.verify` gives for the op-level cases."""
    device = torch.device(device)
    todo = list(selected(ops, impl, dtypes))  # unknown names fail before the model is built
    model = _Model(spec, device)
    references = {op: registry.REFERENCE for op in registry.OPS}
    want = model.run(references, _oracle_dtype(device))
    ref_error: dict[torch.dtype, tuple[float, float]] = {}
    case = f"{spec} model"
    rows: list[Row] = []
    for op, name, im, dtype in todo:
        why = im.unavailable(device.type, dtype)
        if why is not None:
            row = skip_row(op, name, dtype, case, why)
        else:
            if dtype not in ref_error:
                got = model.run(references, dtype)
                ref_error[dtype] = (_rel_err(got[0], want[0]), _rel_err(got[1], want[1]))
            row = _check(model, op, name, dtype, case, want, ref_error[dtype], references)
        rows.append(row)
        if progress:
            progress(row)
    return rows


def _check(model: _Model, op: str, name: str, dtype: torch.dtype, case: str, want, ref_error, references) -> Row:
    fwd_tol = max(FLOORS[dtype], 2 * ref_error[0])
    bwd_tol = max(FLOORS[dtype], 2 * ref_error[1])
    label = registry.dtype_name(dtype)
    try:
        loss, grads = model.run({**references, op: name}, dtype)
    except Exception as e:  # a broken kernel is a FAIL row with its error
        return Row(op, name, label, case, None, None, fwd_tol, bwd_tol, "FAIL", f"{type(e).__name__}: {e}"[:200])
    fwd, bwd = _rel_err(loss, want[0]), _rel_err(grads, want[1])
    ok = fwd <= fwd_tol and bwd <= bwd_tol
    note = "" if ok else ("loss" if fwd > fwd_tol else "gradients") + " error above tolerance"
    return Row(op, name, label, case, fwd, bwd, fwd_tol, bwd_tol, "pass" if ok else "FAIL", note)
