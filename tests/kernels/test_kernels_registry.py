"""The kernel override registry: registering, selecting per op and per module glob, fallback,
plugins (config and entry points), and the CLI's error messages."""

from __future__ import annotations

import logging
import os
import sys
import textwrap

import pytest
import torch
from conftest import REPO, counting, run_cli

from titanite import kernels
from titanite.core.errors import UserError
from titanite.kernels import registry
from titanite.models.qwen3.flavors import get_flavor
from titanite.models.qwen3.model import Qwen3

TINY = get_flavor("debug").replace(vocab_size=256, num_layers=2, hidden_size=64, intermediate_size=96,
                                    head_dim=16)


def tiny_model() -> Qwen3:
    torch.manual_seed(0)
    model = Qwen3(TINY)
    model.init_weights()
    return model


def test_register_checks_the_signature_and_refuses_duplicates(scratch_impls):
    def good(x, weight, eps):
        return kernels.reference("rms_norm")(x, weight, eps)

    kernels.register("rms_norm", "scratch_good")(good)
    scratch_impls.append(("rms_norm", "scratch_good"))
    assert kernels.implementations("rms_norm")["scratch_good"].fn is good
    with pytest.raises(UserError, match="already registered"):
        kernels.register("rms_norm", "scratch_good")(good)
    with pytest.raises(UserError, match=r"signature is \(x.*weight.*eps"):
        kernels.register("rms_norm", "scratch_bad")(lambda x, w, eps: x)  # a renamed parameter
    with pytest.raises(UserError, match="signature"):
        kernels.register("loss", "scratch_bad")(lambda hidden, weight, labels, ignore_index: hidden)  # no default
    with pytest.raises(UserError, match="unknown kernel op 'rms_nrom'.*did you mean 'rms_norm'"):
        kernels.register("rms_nrom", "x")


def test_reference_is_the_ops_oracle_with_its_signature():
    ref = kernels.reference("swiglu")
    g, u = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(ref(g, u), torch.nn.functional.silu(g) * u)
    assert list(registry.signature("moe.experts").parameters) == \
        ["x", "counts", "w_gate_up", "w_down"]


def test_selection_by_op_and_by_module_glob_runs_the_chosen_kernels(scratch_impls, caplog):
    calls: list[str] = []
    counting("rms_norm", "scratch_all", scratch_impls, calls)
    counting("rms_norm", "scratch_qk", scratch_impls, calls)
    model = tiny_model()
    select = {"rms_norm": "scratch_all", "layers.1.attention.[qk]_norm": "scratch_qk"}
    with caplog.at_level(logging.INFO, logger="titanite"):
        bound = kernels.attach(model, select, "cpu", torch.float32)
    assert bound["layers.1.attention.q_norm.kernel"] == "rms_norm:scratch_qk"
    assert bound["layers.0.attention.q_norm.kernel"] == "rms_norm:scratch_all"
    assert bound["norm.kernel"] == "rms_norm:scratch_all"
    assert bound["layers.0.attention.attend"] == "attention:sdpa"  # the op's default
    model(torch.randint(0, 256, (1, 8)))
    # Per forward: 4 norms in each of 2 layers + the final norm; layer 1's q/k norms take the glob.
    assert calls.count("scratch_qk") == 2 and calls.count("scratch_all") == 7
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernel ")]
    assert "kernel rms_norm:scratch_qk: layers.1.attention.q_norm.kernel, layers.1.attention.k_norm.kernel" in logged
    assert len(logged) == len(set(logged))  # each binding logged once


def test_last_matching_glob_wins_and_beats_the_op_key(scratch_impls):
    calls: list[str] = []
    for name in ("scratch_a", "scratch_b"):
        counting("swiglu", name, scratch_impls, calls)
    model = tiny_model()
    bound = kernels.attach(model, {"layers.*": "scratch_a", "layers.1.feed_forward": "scratch_b",
                                   "swiglu": "reference"}, "cpu", torch.float32)
    assert bound["layers.0.feed_forward.swiglu"] == "swiglu:scratch_a"
    assert bound["layers.1.feed_forward.swiglu"] == "swiglu:scratch_b"
    # The `layers.*` glob only touched ops that have an implementation called scratch_a.
    assert bound["layers.0.attention_norm.kernel"] == "rms_norm:reference"


@pytest.mark.parametrize("select, message", [
    ({"rms_norm": "tritn"}, r"no implementation 'tritn' for kernel op 'rms_norm' \(did you mean 'triton'\?\); "
                            r"implementations: reference, triton"),
    ({"rms_nrom": "triton"}, r"\"rms_nrom\" is neither an op \(attention, rms_norm.*\) nor a glob"),
    ({"layers.0.attention": "triton"}, r"no op of the matched modules has an implementation 'triton'; "
                                       r"attention: reference, sdpa, flex"),
])
def test_unknown_ops_and_implementations_list_what_exists(select, message):
    with pytest.raises(UserError, match=message):
        kernels.attach(tiny_model(), select, "cpu", torch.float32)


def test_a_kernel_that_cannot_run_here_is_an_error_or_falls_back_with_a_warning(caplog, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match=r"'flex' for op 'attention' \(\[kernels\] \"attention\" = \"flex\"\) "
                                        r"cannot run here: runs on cuda, not cpu.*kernels.fallback = true"):
        kernels.attach(tiny_model(), {"attention": "flex"}, "cpu", torch.float32)
    moe = Qwen3(get_flavor("debug-moe").replace(vocab_size=256, num_layers=1))
    with pytest.raises(UserError, match="'grouped_mm' for op 'moe.experts'.*supports float32, bfloat16, not float16"):
        kernels.attach(moe, {"moe.experts": "grouped_mm"}, "cpu", torch.float16)
    with caplog.at_level(logging.WARNING, logger="titanite"):
        bound = kernels.attach(tiny_model(), {"rms_norm": "triton"}, "cpu", torch.float32, fallback=True)
    assert set(v for k, v in bound.items() if "norm" in k) == {"rms_norm:reference"}
    assert any("Triton runs on CPU only under TRITON_INTERPRET=1; using the reference" in r.getMessage()
               for r in caplog.records)


def test_plugin_from_config_path_registers_and_a_missing_one_names_the_key():
    before = set(kernels.implementations("rms_norm"))
    kernels.load_plugins([str(REPO / "examples/custom_kernel/titanite_example_kernels")])
    assert set(kernels.implementations("rms_norm")) - before <= {"example_rms_norm"}
    assert kernels.implementations("rms_norm")["example_rms_norm"].source == "titanite_example_kernels"
    with pytest.raises(UserError, match="kernels.plugins.*cannot import 'no_such_kernels_pkg'"):
        kernels.load_plugins(["no_such_kernels_pkg"])


def test_entry_point_plugins_are_loaded_by_the_cli(tmp_path):
    """A package advertising a module in the `titanite.kernels` entry-point group is imported
    without any config; its kernel shows in `titanite kernels list`."""
    (tmp_path / "ep_kernels.py").write_text(textwrap.dedent("""
        import titanite

        @titanite.kernels.register("swiglu", "from_entry_point")
        def swiglu(gate, up):
            return titanite.kernels.reference("swiglu")(gate, up)
    """))
    dist = tmp_path / "ep_kernels-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-kernels\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[titanite.kernels]\nmine = ep_kernels\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = run_cli("kernels", "list", "--device", "cpu", env=env, check=True)
    assert "from_entry_point" in proc.stdout and "[ep_kernels]" in proc.stdout


def test_cli_errors_exit_2_naming_the_op(capsys):
    from titanite.cli import main

    assert main(["kernels", "verify", "rms_nrom"]) == 2
    assert "unknown kernel op 'rms_nrom'" in capsys.readouterr().err
    assert main(["kernels", "verify", "rms_norm", "--impl", "nope"]) == 2
    assert "no implementation 'nope' for kernel op 'rms_norm'" in capsys.readouterr().err


def test_registering_the_builtins_imports_neither_dynamo_nor_triton():
    """Built-ins register without importing torch._dynamo or Triton (seconds on every CLI
    start, and a Triton imported before TRITON_INTERPRET=1 cannot run its kernels on CPU)."""
    import subprocess

    code = ("import sys, titanite.kernels as k\n"
            "for op in k.registry.OPS: k.implementations(op)\n"
            "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
