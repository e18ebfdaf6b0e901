"""The adapter folder in peft's format: `adapter_config.json` + `adapter_model.safetensors`.

Keys are peft's, for the transformers model of the same base:
`base_model.model.<peft layer path>.lora_{A,B}.weight`, with the experts' factors in peft's
fused-experts shapes. Both backends write the same file: the native model's adapters are
placed through a meta-device transformers skeleton of the base with peft's own layers injected
(`peft_layout`), so the names and shapes are peft's, not a copy of its rules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titanite.core.config import LoraConfig, ModelConfig
from titanite.core.errors import UserError
from titanite.formats.safetensors_io import read_header, read_hf_config, write_folder
from titanite.formats.sharded import copy_local
from titanite.models.lora import EXPERT_TARGETS, LoraTarget, factors

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
BASE_NAME = "titanite_base.json"  # beside peft's files (peft ignores it): which base, exactly
PREFIX = "base_model.model."
log = logging.getLogger("titanite")


def peft_layout(cfg: LoraConfig, base_folder: str) -> tuple[dict[str, LoraTarget], torch.nn.Module]:
    """({target key: the target as peft places it}, the module they are named in) on a
    meta-device transformers model of the base checkpoint's config.json."""
    from transformers import AutoModelForCausalLM

    from titanite.models.hf import config as hf_config
    from titanite.models.lora import hf as lora_hf

    config, _, _ = hf_config.resolve(ModelConfig(spec="hf", hf_path=base_folder))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    wrapper = torch.nn.Module()
    wrapper.hf = hf
    return {t.key: t for t in lora_hf.apply(wrapper, cfg)}, wrapper


def _names(target: LoraTarget) -> tuple[str, str]:
    return f"{PREFIX}{target.peft_module}.lora_A.weight", f"{PREFIX}{target.peft_module}.lora_B.weight"


def write_adapter(out: Path, factors, cfg: LoraConfig, base_folder: str, fingerprint: str = "") -> Path:
    """Write the adapter folder atomically. `factors`: (target, A, B) with full canonical
    factors (ModelHandle.adapter_factors); `fingerprint`: base_fingerprint(base_folder), when
    the caller has it."""
    from titanite.models.lora.hf import peft_config

    layout, _ = peft_layout(cfg, base_folder)
    tensors: dict[str, torch.Tensor] = {}
    for t, a, b in factors:
        p = layout[t.key]
        name_a, name_b = _names(p)
        tensors[name_a] = p.a_backend(a).detach().to("cpu").contiguous()
        tensors[name_b] = p.b_backend(b).detach().to("cpu").contiguous()
    config = peft_config(cfg, {t.short_name for t in layout.values()}, str(Path(base_folder).resolve()))

    base = {"base": str(Path(base_folder).resolve()), "fingerprint": fingerprint or base_fingerprint(base_folder)}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        (tmp / BASE_NAME).write_text(json.dumps(base, indent=2) + "\n")

    return write_folder(out, fill)


def read_config(folder: Path) -> tuple[LoraConfig, str]:
    """(titanite's [lora] settings, the base recorded in it) from an adapter folder; anything
    titanite cannot reproduce is refused by name."""
    path = folder / CONFIG_NAME
    if not (folder / WEIGHTS_NAME).is_file() or not path.is_file():
        raise UserError(f"{folder} is not a LoRA adapter folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from e
    if raw.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type is {raw.get('peft_type')!r}; titanite reads LoRA adapters only")
    for key in ("use_dora", "use_rslora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                "layers_to_transform", "modules_to_save", "trainable_token_indices"):
        if raw.get(key):
            raise UserError(f"{path}: '{key}' is {raw[key]!r}, which titanite's adapters cannot represent")
    modules = raw.get("target_modules") or []
    if isinstance(modules, str):
        raise UserError(f"{path}: target_modules is the pattern {modules!r}; titanite needs a list of names")
    params = [p.removeprefix("mlp.") for p in raw.get("target_parameters") or []]
    unknown = [p for p in params if p not in EXPERT_TARGETS]
    if unknown:
        raise UserError(f"{path}: target_parameters {unknown} are not MoE expert projections titanite adapts")
    init = raw.get("init_lora_weights", True)
    if init not in (True, "gaussian"):
        # pissa, olora, loftq, ... change the base weights too: this base plus the factors would
        # not be the adapted model.
        raise UserError(f"{path}: init_lora_weights is {init!r}; titanite reads adapters initialised with "
                        "peft's default (true) or 'gaussian', whose base is the unchanged model")
    if raw.get("bias", "none") != "none":
        raise UserError(f"{path}: bias is {raw['bias']!r}; titanite's adapters have no bias terms")
    try:
        rank, alpha, dropout = int(raw.get("r", 0)), float(raw.get("lora_alpha", 0)), float(raw.get("lora_dropout") or 0)
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: r, lora_alpha and lora_dropout must be numbers: {e}") from e
    if rank <= 0 or alpha <= 0 or not 0 <= dropout < 1:
        raise UserError(f"{path}: r = {rank}, lora_alpha = {alpha:g}, lora_dropout = {dropout:g}; r and "
                        "lora_alpha must be > 0 and lora_dropout in [0, 1)")
    cfg = LoraConfig(enabled=True, rank=rank, alpha=alpha, dropout=dropout, target_modules=sorted(modules) + params,
                     init="gaussian" if init == "gaussian" else "kaiming")
    return cfg, raw.get("base_model_name_or_path") or ""


_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


def base_fingerprint(base_folder: str) -> str:
    """A digest of a base checkpoint: its config.json, each safetensors file's name, size and
    header, and 16 evenly spaced 64 KiB samples of its data (1 MiB a file, not gigabytes), so it
    is cheap at every resume, survives a copy or a move of the folder, and changes when the
    model is replaced by another or re-saved with other weights."""
    folder = Path(base_folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        h.update(json.dumps(read_header(path), sort_keys=True).encode())
        with open(path, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(max(0, (size - _SAMPLE_BYTES) * i // (_SAMPLES - 1)))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def run_record(cfg: LoraConfig, targets: list[LoraTarget], base_folder: str) -> dict:
    """What a LoRA run's checkpoints record of their adapters: the base's fingerprint and the
    [lora] settings they were trained with (trainer state, JSON)."""
    return {"lora_base": base_fingerprint(base_folder),
            "lora": {"rank": cfg.rank, "alpha": cfg.alpha, "targets": [t.key for t in targets]}}


def check_run_record(checkpoint: Path, state: dict, record: dict, base_folder: str) -> None:
    """A LoRA checkpoint continues (or is exported) only on its base and with its [lora]
    settings: DCP loads the keys the model asks for, so fewer targets or another alpha would
    pass silently. `state`: the checkpoint's trainer state; `record`: run_record of now."""
    if state.get("lora_base") != record["lora_base"]:
        raise UserError(f"{checkpoint} holds LoRA adapters trained on another base than model.hf_path = "
                        f"{base_folder} (its config.json or safetensors changed since); point model.hf_path "
                        "at the original base, or use another job.output_dir")
    saved, now = state.get("lora") or {}, record["lora"]
    if saved != now:
        what = [k for k in now if saved.get(k) != now[k]]
        raise UserError(f"{checkpoint} was trained with other [lora] settings ({', '.join(what)} differ: rank "
                        f"{saved.get('rank')}, alpha {saved.get('alpha')}, {len(saved.get('targets', []))} targets; "
                        f"now rank {now['rank']}, alpha {now['alpha']}, {len(now['targets'])} targets); restore "
                        "them, or use another job.output_dir")


def check_base(folder: Path, recorded: str, hf_path: str) -> None:
    """The adapter belongs to the base in hf_path. A titanite adapter names its base's
    fingerprint (BASE_NAME), which must be hf_path's: the same weights, wherever the folder now
    is. Otherwise (another tool's adapter) a recorded base folder that exists must have
    hf_path's architecture; with nothing to compare, a warning says so."""
    from titanite.models.qwen3.args import from_hf_config

    sidecar = folder / BASE_NAME
    if sidecar.is_file():
        try:
            theirs = json.loads(sidecar.read_text())["fingerprint"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{sidecar} is not titanite's base record: {e}") from e
        if theirs != base_fingerprint(hf_path):
            raise UserError(f"adapter {folder} was trained on another base than {hf_path} (its {BASE_NAME} "
                            "names other weights or another config.json), which is not the model in "
                            "model.hf_path; point it at the base the adapter was trained on")
        return
    if not recorded or not Path(recorded).is_dir():
        log.warning("adapter %s records its base as %r, which is not a folder here: cannot check that it "
                    "belongs to %s (its tensor shapes are checked)", folder, recorded, hf_path)
        return
    if Path(recorded).resolve() == Path(hf_path).resolve():
        return
    theirs = from_hf_config(read_hf_config(recorded), where=f"{recorded}/config.json")
    ours = from_hf_config(read_hf_config(hf_path), where=f"{hf_path}/config.json")
    diff = [f.name for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(theirs, f.name)]
    if diff:
        raise UserError(f"adapter {folder} was trained on base {recorded} (its {CONFIG_NAME}), which is not "
                        f"the model in model.hf_path = {hf_path}: config.json differs in {', '.join(diff[:4])}")


def check_adapter(folder: Path, targets: list[LoraTarget], cfg: LoraConfig,
                  base_folder: str) -> dict[str, LoraTarget]:
    """Every tensor name and shape of an adapter folder against what peft holds for this base
    and these targets (headers only); returns the peft layout."""
    path = folder / WEIGHTS_NAME
    header = read_header(path)
    layout, skeleton = peft_layout(cfg, base_folder)
    expected: dict[str, tuple[int, ...]] = {}
    for t in targets:
        p = layout[t.key]
        for name, param in zip(_names(p), factors(skeleton, p)):
            expected[name] = tuple(param.shape)
    for name, shape in expected.items():
        if name not in header:
            raise UserError(f"adapter {path} has no tensor '{name}' (this base and [lora] target_modules need it)")
        if tuple(header[name]["shape"]) != shape:
            raise UserError(f"tensor '{name}' in {path} has shape {header[name]['shape']}, expected {list(shape)} "
                            f"for the base in {base_folder}: the adapter belongs to another model")
    extra = sorted(set(header) - set(expected))
    if extra:
        raise UserError(f"adapter {path} has tensors this model has no place for, e.g. '{extra[0]}' "
                        f"({len(extra)} in all): is it this base's adapter?")
    return layout


@torch.no_grad()
def load_adapter(folder: Path, module: torch.nn.Module, targets: list[LoraTarget], cfg: LoraConfig,
                 base_folder: str, every: list[LoraTarget] | None = None) -> None:
    """Copy an adapter folder's factors into a LoRA model's (materialised, possibly sharded) targets,
    after checking every name and shape against what peft would hold for this base. every: the
    whole model's targets when `module` holds only some (a pipeline stage), checked in full."""
    path = folder / WEIGHTS_NAME
    layout = check_adapter(folder, every or targets, cfg, base_folder)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for t in targets:
            p = layout[t.key]
            name_a, name_b = _names(p)
            a, b = factors(module, t)
            copy_local(a, t.a_backend(p.a_canonical(f.get_tensor(name_a).float())))
            copy_local(b, t.b_backend(p.b_canonical(f.get_tensor(name_b).float())))
