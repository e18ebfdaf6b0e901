"""titanite on an out-of-tree PrivateUse1 device (tests/device's `tdev`), each path against the
same run on the CPU: the three tiny seed configs (both backends, dense and MoE), compile, bf16
autocast, chat SFT with packing + evaluation + LoRA, generation, the kernel registry, and the
data prefetcher with and without pinned memory. Checkpoints and several ranks are in
test_device_runs.py; bad input on the device is at the end here.
"""

from __future__ import annotations

import pytest

from tests.chat_fixtures import make_chat_tokenizer, toy_conversations, write_jsonl
from tests.conftest import REPO, make_hf_checkpoint, read_metrics, tiny_train_args
from tests.device_runs import assert_same_losses, on_tdev, torchrun_on_tdev, train_on_cpu, train_on_tdev

# -- the three seed setups --------------------------------------------------------------------
# name: (config, overrides on both sides, overrides on tdev only, environment on tdev, log lines on tdev)
SEEDS = {
    # data prefetched into pinned host memory (the device has it)
    "native": ("seed-native-tiny", {}, {}, {}, ["prefetching 2 batches ahead, in pinned host memory"]),
    # the transformers backend; a device without pinned memory prefetches from pageable memory.
    # SDPA takes its math path on the device and the fused kernel on the CPU: compare the
    # reference attention on both.
    "hf": ("seed-hf-tiny", {"kernels.attention": "reference"}, {}, {"TITANITE_TESTDEV_PINNED": "0"},
           ["prefetching 2 batches ahead, in pageable host memory"]),
    # grouped_mm is declared for cpu and cuda: on tdev the run falls back to the reference, as
    # configured, and still matches the CPU's grouped_mm
    "moe": ("seed-moe-kernels-tiny", {}, {"kernels.fallback": "true"}, {},
            ["using the reference (kernels.fallback = true)"]),
    # torch.compile on a device inductor does not know: aot_eager, with a warning
    "native_compiled": ("seed-native-tiny", {}, {"parallelism.compile": "true"}, {},
                        ["compiling with the 'aot_eager' backend"]),
}


@pytest.mark.parametrize("name", list(SEEDS))
def test_seed_config_on_device_matches_cpu(name, tmp_path):
    config, both, device_only, env, expected = SEEDS[name]
    common = [f"--config={REPO / 'configs' / (config + '.toml')}", *(f"--{k}={v}" for k, v in both.items())]
    train_on_cpu([*common, f"--job.output_dir={tmp_path / 'cpu'}"])
    proc = train_on_tdev([*common, f"--job.output_dir={tmp_path / 'tdev'}",
                          *(f"--{k}={v}" for k, v in device_only.items())], env=env)
    for line in expected + ["device tdev:0", "mem n/a (host"]:
        assert line in proc.stderr, (line, proc.stderr[-3000:])
    assert_same_losses(tmp_path / "cpu", tmp_path / "tdev")
    assert (tmp_path / "tdev" / "hf" / "config.json").is_file()


# -- bf16 autocast ----------------------------------------------------------------------------

def test_bf16_autocast_on_device(tmp_path, tiny_hf, tiny_data):
    """The device's own autocast policy (PyTorch's published lower-precision and fp32 op lists)
    differs from the CPU's, so bf16 runs agree to bf16's precision, not bitwise; and autocast
    really acted on the device: its run differs from the fp32 run."""
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "x", steps=4, **{"checkpoint.interval": 0})
    train_on_cpu([*args, f"--job.output_dir={tmp_path / 'cpu'}", "--training.mixed_precision=bf16"])
    train_on_tdev([*args, f"--job.output_dir={tmp_path / 'tdev'}", "--training.mixed_precision=bf16"])
    train_on_tdev([*args, f"--job.output_dir={tmp_path / 'fp32'}"])
    assert_same_losses(tmp_path / "cpu", tmp_path / "tdev", rel=2e-3, first_grad_norm_rel=2e-2)
    bf16, fp32 = read_metrics(tmp_path / "tdev"), read_metrics(tmp_path / "fp32")
    assert any(a["loss"] != b["loss"] for a, b in zip(bf16, fp32, strict=True))


# -- chat SFT with packing, evaluation and LoRA; then generation from the export -------------

@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    hf = make_hf_checkpoint(root / "hf", make_chat_tokenizer(root / "tok"))
    return hf, write_jsonl(root / "chat.jsonl", toy_conversations(3))


def test_chat_lora_with_packing_and_eval_on_device(tmp_path, chat):
    hf, data = chat
    args = tiny_train_args(hf, data, tmp_path / "x", steps=4, **{
        "data.format": "chat", "data.packing": "documents", "data.seq_len": 64, "training.batch_size": 2,
        "eval.path": data, "eval.interval": 2, "lora.enabled": "true", "lora.rank": 4, "lora.alpha": 8,
        "lora.dropout": 0.1, "training.lr": 1e-2, "checkpoint.interval": 0, "checkpoint.export_merged": "true"})
    train_on_cpu([*args, f"--job.output_dir={tmp_path / 'cpu'}"])
    train_on_tdev([*args, f"--job.output_dir={tmp_path / 'tdev'}"])
    assert_same_losses(tmp_path / "cpu", tmp_path / "tdev")
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(tmp_path / "tdev") if "eval_loss" in r]
    cpu_evals = [(r["step"], r["eval_loss"]) for r in read_metrics(tmp_path / "cpu") if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 4] == [s for s, _ in cpu_evals]
    assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(evals, cpu_evals, strict=True))
    assert (tmp_path / "tdev" / "adapter" / "adapter_config.json").is_file()

    # Generation from the merged export, sampled with a seed (the device's own generator draws),
    # writes on the device what it writes on the CPU.
    outputs = {}
    for device in ("cpu", "tdev"):
        proc = on_tdev("generate", "--model", str(tmp_path / device / "hf"), "--prompt", "capital of france?",
                       "--max-new-tokens", "12", "--temperature", "1.0", "--seed", "3", "--device", device,
                       "--dtype", "float32")
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[device] = proc.stdout
    assert outputs["tdev"] == outputs["cpu"] and outputs["cpu"].strip(), outputs


# -- the kernel registry on the device --------------------------------------------------------

PLUGIN = "tests/device_kernels.py"


def test_kernels_declared_for_the_device_are_chosen_there_and_refused_elsewhere(tmp_path, tiny_hf, tiny_data):
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "x", steps=2, **{
        "checkpoint.interval": 0, "kernels.plugins": f'["{PLUGIN}"]', "kernels.rms_norm": "tdev_rms_norm"})
    proc = train_on_tdev([*args, f"--job.output_dir={tmp_path / 'tdev'}"])
    assert "kernel rms_norm:tdev_rms_norm" in proc.stderr
    # On the CPU the same selection is refused, naming the kernel and the devices it runs on ...
    refused = on_tdev("train", *args, f"--job.output_dir={tmp_path / 'cpu'}", "--job.device=cpu")
    assert refused.returncode == 2 and "runs on tdev, not cpu" in refused.stderr, refused.stderr[-2000:]
    # ... or falls back to the reference when the config allows it, with the same losses.
    train_on_cpu([*args, f"--job.output_dir={tmp_path / 'cpu'}", "--kernels.fallback=true"])
    assert_same_losses(tmp_path / "cpu", tmp_path / "tdev")


def test_kernels_verify_runs_on_the_device():
    proc = on_tdev("kernels", "verify", "--device", "tdev")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tdev" in proc.stdout and "FAIL" not in proc.stdout


# -- bad input on the device: one message, exit 2 ---------------------------------------------

BAD = {
    "unknown device": ({}, "--job.device=nosuch", "unknown device 'nosuch'"),
    "no device present": ({"TITANITE_TESTDEV_COUNT": "0"}, "--job.device=tdev", "'tdev' is not available"),
    "index past the count": ({}, "--job.device=tdev:7", "tdev:7 is not available: this machine has 4"),
    "kernel for another device": ({}, "--job.device=tdev", "'flex' for op 'attention'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_device_input_is_one_message(case, tmp_path, tiny_hf, tiny_data):
    env, device, message = BAD[case]
    extra = {"kernels.attention": "flex"} if "kernel" in case else {}
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "run", steps=1, **extra)
    proc = on_tdev("train", *args, device, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("titanite: error")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_device_without_a_c10d_backend_under_torchrun(tmp_path, tiny_hf, tiny_data):
    args = tiny_train_args(tiny_hf, tiny_data, tmp_path / "run", steps=1)
    proc = torchrun_on_tdev(2, args, env={"TITANITE_TESTDEV_C10D": "0"})
    assert proc.returncode != 0
    errors = {line.split("] ", 1)[-1] for line in proc.stderr.splitlines() if "titanite: error" in line}
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "no torch.distributed backend is registered for device type 'tdev'" in errors.pop()
    assert "exitcode  : 2" in proc.stderr or "exit code 2" in proc.stderr or "(exitcode: 2)" in proc.stderr, \
        proc.stderr[-3000:]


# -- the test device behaves as a vendor's device, not as the CPU under another name -----------

DEVICE_BASICS = r'''
import io, torch, titanite_testdev
assert torch.accelerator.current_accelerator().type == "tdev" and torch.accelerator.device_count() == 4
x = torch.arange(6.0, device="tdev:1")
assert x.device == torch.device("tdev", 1) and x.untyped_storage().device.type == "tdev"
buf = io.BytesIO(); torch.save({"w": torch.ones(3)}, buf); buf.seek(0)
assert torch.load(buf, map_location="tdev", weights_only=True)["w"].device.type == "tdev"
torch.manual_seed(5); a = torch.rand(4, device="tdev")
torch.manual_seed(5); torch.random.default_generator.manual_seed(6); b = torch.rand(4, device="tdev")
assert torch.equal(a.cpu(), b.cpu())  # the device draws from its own generator, not the CPU's
torch.tdev.manual_seed_all(5); c = torch.rand(4, device="tdev:0"); torch.rand(4, device="tdev:0")
assert torch.equal(torch.rand(4, device="tdev:1").cpu(), c.cpu())  # each device has its own state
with torch.autocast("tdev", dtype=torch.bfloat16):
    assert (x[:4].view(2, 2) @ x[:4].view(2, 2)).dtype == torch.bfloat16
s, e = torch.tdev.Stream(), torch.tdev.Event(enable_timing=True)
with torch.tdev.stream(s):
    assert torch.accelerator.current_stream().stream_id == s.stream_id
e.record(); e.synchronize()
print("ok")
'''


def test_the_test_device_is_its_own_device():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DEVICE_BASICS], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_device_id_goes_only_to_backends_that_take_it():
    import torch

    from titanite.device.choice import process_group_kwargs

    gpu = torch.device("cuda", 1)
    assert process_group_kwargs(gpu, "cpu:gloo,cuda:nccl") == {"device_id": gpu}
    assert process_group_kwargs(gpu, "cpu:gloo,cuda:vendorccl") == {}  # a plugin backend
    assert process_group_kwargs(torch.device("cpu"), "gloo") == {}
