"""The step path reads nothing on the host except on logging, checkpoint and last steps.

On an accelerator every host read of a device tensor (`.item()`, `float()`, `bool()`, `.tolist()`)
drains the queue, so the next step cannot be enqueued while this one runs. The test counts those
calls (and `torch.equal`) per step of a real training loop (dense, and MoE with its aux loss and
expert-load stats, with gradient accumulation and packed documents; both backends) and requires
zero on the other steps.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MOE, make_hf_checkpoint, read_metrics, tiny_train_args
from titanite.core.config import load_config
from titanite.run.trainer import Trainer

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@pytest.mark.parametrize("spec", ["qwen3", "hf"])
@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_no_host_reads_on_non_logging_steps(tmp_path, tiny_tokenizer_dir, tiny_data, monkeypatch, arch, spec):
    extra = dict(TINY_MOE, output_router_logits=True, router_aux_loss_coef=0.01) if arch == "moe" else {}
    folder = make_hf_checkpoint(tmp_path / "hf", tiny_tokenizer_dir, **extra)
    out = tmp_path / "run"
    trainer = Trainer(load_config(None, tiny_train_args(folder, tiny_data, out, steps=8, **{
        "model.spec": spec, "metrics.log_interval": 4, "checkpoint.interval": 0, "checkpoint.export_hf": False,
        "training.batch_size": 2, "training.global_batch_size": 4,  # two micro-batches per step
        "data.packing": "documents"})))  # packed documents: the block-causal attention path too
    reads = {"n": 0}
    per_step: list[int] = []

    def counted(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **kw):
            reads["n"] += 1
            return real(self, *a, **kw)
        return wrapper

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    real_equal = torch.equal  # a comparison answered on the host

    def equal(*a, **kw):
        reads["n"] += 1
        return real_equal(*a, **kw)
    monkeypatch.setattr(torch, "equal", equal)
    real_step = Trainer.train_step

    def step(self):  # reads from the start of one step to the start of the next
        if trainer.step > 0:
            per_step.append(reads["n"])
        reads["n"] = 0
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    trainer.train()
    per_step.append(reads["n"])  # the last step, its log, save and checks
    monkeypatch.undo()
    assert len(per_step) == 8
    logged = [r["step"] for r in read_metrics(out)]
    assert logged == [1, 4, 8]
    quiet = {s: n for s, n in enumerate(per_step, start=1) if s not in logged}
    assert quiet == dict.fromkeys(quiet, 0), quiet
    assert all(per_step[s - 1] > 0 for s in logged)  # the counter sees the reads that do happen
    if arch == "moe":
        assert "aux_loss" in read_metrics(out)[0] and "moe/max_over_mean" in read_metrics(out)[0]
