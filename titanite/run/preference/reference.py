"""The reference policy of preference training, and the log-probabilities it gives each pair.

preference.reference picks one of:
- 'model': a frozen model held beside the policy, built like it (same backend, kernels and
  parallel layout: FSDP2/TP/EP shard it as they shard the policy), with no gradients and no
  optimizer state; its weights are preference.reference_path, else the policy's starting
  weights (model.hf_path, or the seeded init of a run from scratch). With LoRA and no
  reference_path, there is no second model: the reference is the policy with its adapters
  switched off (their scale set to 0 for the reference's forward, which is then exactly the
  base's).
- 'precomputed': that same reference runs once, before training, over every pair of the
  training (and held-out) data; the log-probabilities are kept in a file beside the token store
  (keyed by the store, the reference's weights and how they are computed), and the model is
  dropped before the first step. A later run (a resume) reads the file.
- 'none' (or a reference-free loss): nothing.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from titanite import kernels
from titanite.core.config import REFERENCE_FREE_LOSSES, Config, KernelsConfig, ModelConfig
from titanite.core.errors import UserError
from titanite.data.packing import PairWindows
from titanite.data.store import TokenStore
from titanite.data.tokenizer import Tokenizer
from titanite.kernels import IGNORE_INDEX, context_parallel
from titanite.models.handle import ModelHandle, TrainOutput
from titanite.models.lora.native import LoraGroupedExperts, LoraLinear
from titanite.models.spec import get_spec
from titanite.parallel import context, distributed
from titanite.parallel.plans import parallelize

log = logging.getLogger("titanite")

# config.json keys that must agree between the policy and a reference_path model.
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "tie_word_embeddings")


def uses_reference(cfg: Config) -> bool:
    pr = cfg.preference
    return cfg.training.objective == "dpo" and pr.reference != "none" and pr.loss_type not in REFERENCE_FREE_LOSSES


def adapters_are_reference(cfg: Config) -> bool:
    """LoRA without reference_path: the reference is the base, the policy with adapters off."""
    return uses_reference(cfg) and cfg.lora.enabled and not cfg.preference.reference_path


def reference_model_config(cfg: Config) -> ModelConfig | None:
    """The [model] of a separate reference model, or None when there is none to build."""
    if not uses_reference(cfg) or adapters_are_reference(cfg):
        return None
    path = cfg.preference.reference_path
    return replace(cfg.model, hf_path=path, init="pretrained") if path else cfg.model


def check_reference(cfg: Config, policy: ModelHandle, kernels_cfg: KernelsConfig, device_type: str,
                    dtype: torch.dtype, tokenizer: Tokenizer, start_weights: str | None
                    ) -> tuple[ModelHandle | None, str | None]:
    """Preflight: the separate reference model on the meta device, kernels attached, its weights,
    architecture and tokenizer checked against the policy's, and the folder it loads (None:
    the seeded init). (None, None) when there is no separate reference.
    `start_weights`: the folder a fresh run of the policy loads (None: random init)."""
    mcfg = reference_model_config(cfg)
    if mcfg is None:
        return None, None
    path = cfg.preference.reference_path
    if path:
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise UserError(f"config key 'preference.reference_path': {folder} is not a Hugging Face model folder "
                            "(no config.json)")
        if not any(folder.glob("*.safetensors")):
            raise UserError(f"config key 'preference.reference_path': {folder} has no *.safetensors weights "
                            "(titanite reads safetensors only)")
    handle = get_spec(mcfg.spec).build(mcfg)
    if path:
        ours, theirs = policy.hf_config(), handle.hf_config()
        diff = [f"{k}: {theirs.get(k)!r} (the policy has {ours.get(k)!r})" for k in ARCH_KEYS
                if ours.get(k) != theirs.get(k)]
        if diff:
            raise UserError(f"config key 'preference.reference_path': {path} is another architecture than the "
                            f"policy ({'; '.join(diff)}); the reference must be the same model with other weights")
        tok = Path(path).expanduser() / "tokenizer.json"
        if tok.is_file() and _sha(tok) != _sha(tokenizer.path):
            raise UserError(f"config key 'preference.reference_path': {tok} differs from the run's tokenizer "
                            f"{tokenizer.path}; the reference must read the same token ids as the policy")
        handle.check_hf(path)
    elif start_weights is not None:
        handle.check_hf(start_weights)
    handle.attach_kernels(kernels_cfg, device_type, dtype)
    return handle, (path or start_weights)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def materialize_reference(handle: ModelHandle, weights: str | None, cfg: Config, world: Any,
                          device: torch.device) -> None:
    """Shard the reference as the policy is sharded, allocate it and load `weights` (None: the
    seeded init, as the policy's); frozen, in eval mode."""
    ref_cfg = replace(cfg, parallelism=replace(cfg.parallelism, activation_checkpoint="none"),
                      lora=replace(cfg.lora, enabled=False))
    parallelize(handle, world, ref_cfg)
    handle.module.to_empty(device=device)
    handle.init_buffers()
    if weights is not None:
        handle.load_hf(weights)
    else:
        torch.manual_seed(cfg.job.seed)
        handle.init_weights(cfg.model.init_std, cfg.job.seed)
    handle.init_buffers()
    for p in handle.module.parameters():
        p.requires_grad_(False)
    handle.module.eval()
    log.info("preference: reference model %s loaded on every rank (frozen, sharded as the policy)",
             weights or "initialised from job.seed as the policy was")


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module) -> Iterator[None]:
    """Every LoRA adapter of `module` at scale 0 (titanite's native adapters and peft's): the
    forward is then exactly the base model's."""
    saved: list[tuple[Any, str, Any]] = []
    for m in module.modules():
        if isinstance(m, (LoraLinear, LoraGroupedExperts)):
            saved.append((m, "scale", m.scale))
            m.scale = 0.0
        elif isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A"):  # peft's LoRA layers
            saved.append((m, "scaling", dict(m.scaling)))
            m.scaling = {k: 0.0 for k in m.scaling}
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def sequence_logps(handle: ModelHandle, batch: dict[str, torch.Tensor], autocast: Any
                   ) -> tuple[TrainOutput, torch.Tensor, torch.Tensor]:
    """A forward of `handle` on a device batch: its output, and per row the summed log-probability
    of the labelled tokens and how many there are (fp32 [R] each). The head's `loss` op gives one
    sum per row (kernels.loss_per_row: the chunked loss never holds the [R, S, V] logits); a
    vocabulary-sharded head (tensor parallel) returns logits, gathered here, as loss_parallel
    reduces only to a sum or a mean."""
    labels = batch["labels"]
    with kernels.loss_per_row():
        with autocast:
            out = handle.forward_train(batch)
    if out.loss_sum is not None:
        nll = distributed.full_tensor(out.loss_sum)
    else:
        logits = distributed.full_tensor(out.logits)
        nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                              reduction="none").view(labels.shape).sum(1)
    # under context parallelism a rank holds chunks of each row: the whole rows' sums
    return out, -context_parallel.sum_rows(nll), context_parallel.sum_rows((labels != IGNORE_INDEX).sum(1).float())


class Reference:
    """The reference's summed completion log-probs for a device batch of pairs."""

    def __init__(self, kind: str, handle: ModelHandle | None, world: Any, autocast: Any, cp: Any = None) -> None:
        self.kind = kind  # 'model', 'adapters_off' or 'precomputed'
        self.handle, self.world, self.autocast = handle, world, autocast
        self.cp = cp  # titanite.parallel.context.ContextParallel, or None
        self.tables: dict[str, torch.Tensor] = {}
        self.separate = kind == "model"  # a model of its own (not the policy with adapters off)
        self.materialized = not self.separate  # a separate model is allocated on first need

    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [B], rejected [B]) from a forward of the reference model."""
        assert self.handle is not None
        ctx = adapters_off(self.handle.module) if self.kind == "adapters_off" else contextlib.nullcontext()
        was_training = self.handle.module.training
        self.handle.module.eval()
        try:
            with ctx:
                _, logps, _ = sequence_logps(self.handle, batch, self.autocast)
        finally:
            self.handle.module.train(was_training)
        if self.kind == "model" and isinstance(self.handle.module, FSDPModule):
            # FSDP2 keeps a root module's parameters gathered after its forward (it expects the
            # backward); the frozen reference has none, so its root group goes back to shards.
            self.handle.module.reshard()
        return logps.chunk(2)

    def logps(self, batch: dict[str, torch.Tensor], split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "precomputed":
            rows = self.tables[split][batch["pair_index"]]
            return rows[:, 0], rows[:, 1]
        return self.forward(batch)

    def precompute(self, split: str, windows: PairWindows, store: TokenStore, key: dict[str, Any],
                   batch_size: int, device: torch.device, materialize: Callable[[], None]) -> None:
        """Fill tables[split] from the file beside `store`, or run this reference over every pair
        (each data-parallel rank a share; `materialize` first) and write the file."""
        path = store.path.parent / f"{store.path.name}.reference-{_key(store, key)}.safetensors"
        table = _read_table(path, len(windows))
        if self.world.any_rank(table is None):
            materialize()
            table = self._run(windows, batch_size, device, split)
            if int(os.environ.get("RANK", "0")) == 0:
                _write_table(path, table)
        self.tables[split] = table.to(device)

    def _run(self, windows: PairWindows, batch_size: int, device: torch.device, split: str) -> torch.Tensor:
        n, w = len(windows), self.world
        global_batch = batch_size * w.dp_size
        table = torch.zeros(n, 2, device=device)
        start, steps = time.perf_counter(), math.ceil(n / global_batch)
        log.info("preference: computing the reference's log-probabilities of %d %s pairs (%d batches)", n, split, steps)
        for g in range(steps):
            idx = g * global_batch + w.dp_rank * batch_size + np.arange(batch_size)
            valid = torch.from_numpy(idx < n).to(device)
            idx = np.minimum(idx, n - 1)
            batch = windows.batch(idx)
            batch = {k: v.to(device) for k, v in context.split(self.cp, batch).items()}
            with context.micro_batch(self.cp, batch):
                c, r = self.forward(batch)
            rows = torch.stack([c, r], 1) * valid[:, None]
            table.index_add_(0, batch["pair_index"], rows)
            if steps >= 10 and (g + 1) % max(1, steps // 10) == 0:
                log.info("preference: reference log-probs %d/%d batches (%.0f s)", g + 1, steps,
                         time.perf_counter() - start)
        return w.all_reduce_sum_dp(table)

    def release(self) -> None:
        """Drop the model once every table is computed ('precomputed')."""
        if self.handle is not None and self.separate and self.materialized:
            log.info("preference: reference model released; training reads the precomputed log-probabilities")
        self.handle = None
        gc.collect()


def _key(store: TokenStore, key: dict[str, Any]) -> str:
    full = {"store": str(store.path.resolve()), "created": store.manifest.get("created"), **key}
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_identity(folder: str) -> list[Any]:
    """What a folder's weights are, for the precomputed file's key: its safetensors' names, sizes
    and modification times."""
    files = sorted(Path(folder).expanduser().glob("*.safetensors"))
    return [str(Path(folder).expanduser().resolve())] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                                         for f in files]


def _read_table(path: Path, n: int) -> torch.Tensor | None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        table = load_file(str(path))["logps"]
    except (SafetensorError, KeyError, OSError) as e:
        log.warning("preference: %s is unreadable (%s); computing the reference's log-probs again", path, e)
        return None
    if tuple(table.shape) != (n, 2):
        log.warning("preference: %s holds %s, not %d pairs; computing again", path, tuple(table.shape), n)
        return None
    log.info("preference: reference log-probabilities read from %s", path)
    return table


def _write_table(path: Path, table: torch.Tensor) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        save_file({"logps": table.detach().cpu().contiguous()}, str(tmp))
        os.replace(tmp, path)
        log.info("preference: reference log-probabilities saved to %s", path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("preference: could not save the reference's log-probs beside the token store (%s); "
                    "a resumed run computes them again", e)
