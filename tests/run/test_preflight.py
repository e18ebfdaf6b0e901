"""Exit 2 writes nothing: every kind of user error, found at preflight or while loading the data,
leaves a new output folder absent and an existing one exactly as it was."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_metrics, tiny_train_args
from titanite import cli

BAD = {  # name -> overrides (on top of a valid tiny run) that make it fail with exit 2
    "unknown key": ({"training.lrr": 1}, "training.lrr"),
    "bad value": ({"training.lr": "nan"}, "training.lr"),
    "missing data": ({"data.path": "/nonexistent/data.jsonl"}, "does not exist"),
    "missing tokenizer": ({"data.tokenizer": "/nonexistent/tokenizer.json"}, "data.tokenizer"),
    "unknown kernel": ({"kernels.loss": "no_such_kernel"}, "no_such_kernel"),
    "kernel that cannot run here": ({"kernels.attention": "flex"}, "flex"),
    "layout": ({"parallelism.tp": 3}, "world size"),
    "seq_len beyond the model": ({"data.seq_len": 4096}, "max_position_embeddings"),
    "too little data (found while packing)": ({"training.batch_size": 400}, "one global batch needs"),
    "malformed data (found while reading)": ({"data.path": "BROKEN"}, "not valid JSON"),
}


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("existing", [False, True], ids=["new folder", "existing run"])
@pytest.mark.parametrize("case", BAD)
def test_exit_2_writes_nothing(tmp_path, capsys, tiny_hf, tiny_data, case, existing):
    overrides, fragment = BAD[case]
    if overrides.get("data.path") == "BROKEN":
        broken = tmp_path / "broken.jsonl"
        broken.write_text(tiny_data.read_text() + "{not json\n")
        overrides = {**overrides, "data.path": broken}
    out = tmp_path / "run"
    if existing:  # a finished run whose folder must survive the failed attempt untouched
        assert cli.main(["train", *tiny_train_args(tiny_hf, tiny_data, out, steps=2)]) == 0
        assert len(read_metrics(out)) == 2
        (out / "notes.txt").write_text(json.dumps({"keep": True}))
        before = _snapshot(out)
    capsys.readouterr()
    code = cli.main(["train", *tiny_train_args(tiny_hf, tiny_data, out, steps=4, **overrides)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert fragment in err and "Traceback" not in err, err[-2000:]
    if existing:
        assert _snapshot(out) == before
    else:
        assert not out.exists()
