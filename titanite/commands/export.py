"""`titanite export`: a DCP training checkpoint -> a Hugging Face folder."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from titanite.checkpoint import training_state
from titanite.commands.base import setup_logging
from titanite.core.config import DEFAULT_SHARD_MB, Config, load_config
from titanite.core.errors import UserError
from titanite.data.tokenizer import load_tokenizer
from titanite.formats import dcp_safe
from titanite.formats.hf_weights import export_hf
from titanite.models.handle import ModelHandle
from titanite.models.lora.adapter import check_run_record, run_record, write_adapter
from titanite.models.spec import get_spec
from titanite.parallel.distributed import region_bounds

log = logging.getLogger("titanite")


def _checkpoint_config(checkpoint: Path, trust_remote_code: bool) -> Config:
    config_file = checkpoint / "config.toml"
    if not config_file.is_file():
        raise UserError(f"{checkpoint} has no config.toml: not a titanite checkpoint folder (checkpoints/step-N)")
    cfg = load_config(config_file)
    if cfg.model.trust_remote_code and not trust_remote_code:
        log.warning("%s sets model.trust_remote_code = true; ignored (pass --trust-remote-code to allow it)",
                    config_file)
    cfg.model.trust_remote_code = trust_remote_code
    return cfg


def load_checkpoint_model(checkpoint: Path, trust_remote_code: bool = False,
                          base: bool = True) -> tuple[Config, ModelHandle]:
    """The run config and its model, restored on CPU from a checkpoints/step-N folder.

    The checkpoint is verified first (manifest, hashes, safe metadata). Its config.toml is data
    from the checkpoint, so nothing in it may run code: `model.trust_remote_code` is taken from
    the caller (off unless the user passes it), and `kernels.plugins` is not imported (exports
    and generation do not need kernels). `base=False` (LoRA: writing the adapter alone) leaves the
    frozen base unread."""
    cfg = _checkpoint_config(checkpoint, trust_remote_code)
    handle = get_spec(cfg.model.spec).build(cfg.model)
    if cfg.lora.enabled:  # the checkpoint holds the adapters; the base is model.hf_path's
        handle.apply_lora(cfg.lora)
        handle.check_hf(cfg.model.hf_path)
    handle.module.to_empty(device="cpu")
    handle.init_buffers()
    with torch.no_grad():
        if handle.lora is not None and base:
            handle.load_hf(cfg.model.hf_path)
        state = training_state.load(checkpoint, handle.module, optimizer=None)
    if handle.lora is not None:
        record = run_record(handle.lora.cfg, handle.lora.targets, cfg.model.hf_path)
        check_run_record(checkpoint, state, record, cfg.model.hf_path)
    return cfg, handle


def export_checkpoint(checkpoint: Path, out: Path, shard_mb: int, trust_remote_code: bool = False,
                      merged: bool = False) -> Path:
    """A LoRA checkpoint gives its adapter in peft's format, or with `merged` the base with the
    adapters merged in; any other checkpoint gives its model."""
    cfg = _checkpoint_config(checkpoint, trust_remote_code)
    if not merged and not cfg.lora.enabled:
        return stream_export(checkpoint, out, shard_mb, cfg)
    cfg, handle = load_checkpoint_model(checkpoint, trust_remote_code, base=merged)
    if merged and handle.lora is None:
        raise UserError(f"--merged: {checkpoint} is not a LoRA run's checkpoint (lora.enabled is false); "
                        "export it without --merged")
    if handle.lora is not None and not merged:
        path = write_adapter(out, handle.adapter_factors(), handle.lora.cfg, cfg.model.hf_path)
        log.info("exported the LoRA adapter of %s to %s (peft format; --merged for the merged model)",
                 checkpoint, path)
        return path
    tokenizer_files = []
    if cfg.data.tokenizer or cfg.model.hf_path:
        tokenizer_files = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path).files
    path = export_hf(handle.hf_state_dict(merged=merged), handle.hf_config(), out, shard_mb,
                     source_folders=[cfg.model.hf_path], tokenizer_files=tokenizer_files)
    log.info("exported %s to %s", checkpoint, path)
    return path


def stream_export(checkpoint: Path, out: Path, shard_mb: int, cfg: Config) -> Path:
    """Export a (non-LoRA) checkpoint without restoring the model: the model stays on the meta
    device and each on-disk tensor (one expert's matrix for MoE) is read from the checkpoint as
    it is written, so memory holds one such tensor plus the stored chunks it overlaps."""
    handle = get_spec(cfg.model.spec).build(cfg.model)
    problems = training_state.verify(checkpoint)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise training_state.CheckpointUnusable(f"checkpoint {checkpoint} failed verification: {problems[0]}{more}")
    state = {f"model.{k}": v for k, v in handle.module.state_dict().items() if not handle.is_alias(k)}
    dcp_safe.check_compatible(dcp_safe.read_metadata(checkpoint), state, checkpoint)

    def regions(name: str, t: torch.Tensor, indices: list) -> Iterator[torch.Tensor]:
        for index in indices:
            lo, hi = region_bounds(t.shape, index)
            box = dcp_safe.read_box(checkpoint, f"model.{name}", lo, [b - a for a, b in zip(lo, hi)], t.dtype)
            yield box.reshape(torch.empty(t.shape, device="meta")[index].shape)

    for name, t in handle.module.state_dict().items():
        if name.endswith("router.expert_bias") and bool(next(regions(name, t, [()])).any()):
            log.warning("the MoE routing bias (model.moe_bias_update_rate) is not part of the Hugging Face "
                        "layout and is left out of the export: transformers will route without it")
            break
    tokenizer_files = []
    if cfg.data.tokenizer or cfg.model.hf_path:
        tokenizer_files = load_tokenizer(cfg.data.tokenizer, cfg.model.hf_path).files
    path = export_hf(handle.hf_state_dict(regions), handle.hf_config(), out, shard_mb,
                     source_folders=[cfg.model.hf_path], tokenizer_files=tokenizer_files)
    log.info("exported %s to %s, one tensor at a time", checkpoint, path)
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titanite export",
                                     description="Turn a training checkpoint into a Hugging Face folder "
                                                 "(for a LoRA run: its adapter in peft's format, or with "
                                                 "--merged the base with the adapters merged in).")
    parser.add_argument("--checkpoint", required=True, help="a checkpoints/step-N folder")
    parser.add_argument("--out", required=True, help="output folder (replaced atomically)")
    parser.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_MB, help="largest safetensors shard, MB")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let code shipped in the run's model.hf_path run (hf spec); off by default, "
                             "whatever the checkpoint's config.toml says")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA runs: write the base with the adapters merged in (loads without peft)")
    args = parser.parse_args(argv)
    setup_logging()
    export_checkpoint(Path(args.checkpoint), Path(args.out), args.shard_mb, args.trust_remote_code,
                      merged=args.merged)
    return 0
