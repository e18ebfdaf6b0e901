"""Benchmarks through lm-evaluation-harness: `titanite eval` and `[eval] tasks` against lm-eval's
own `hf` model (transformers doing the forward) on the same folder, with local task YAMLs and
local data files (no network): a multiple-choice task, a perplexity task (several rolling
windows per document) and a generation task with stop sequences."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import corpus_texts, make_hf_checkpoint, read_metrics, run_cli, tiny_train_args, write_corpus

lm_eval = pytest.importorskip("lm_eval")

TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]
MAX_POSITIONS = 64  # short, so the longer perplexity documents take several windows


def _task(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


def _metric(name: str, aggregation: str, higher: bool) -> str:
    return f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: {str(higher).lower()}\n"


def write_tasks(folder: Path) -> Path:
    """tiny_mc (16 questions, 4 choices of 1-3 words), tiny_ppl (4 documents of 20-140 words),
    tiny_gen (4 prompts, stop at a newline or a full stop, at most 8 tokens)."""
    folder.mkdir(parents=True)
    words = " ".join(corpus_texts(40)).split()
    r = random.Random(0)
    phrase = lambda n: " ".join(r.choice(words) for _ in range(n))  # noqa: E731
    rows = {
        "mc": [{"question": phrase(6 + i % 5), "choices": [phrase(1 + (i + j) % 3) for j in range(4)], "answer": i % 4}
               for i in range(16)],
        "ppl": [{"text": phrase(20 + 40 * i)} for i in range(4)],
        "gen": [{"question": phrase(8), "answer": phrase(1)} for _ in range(4)],
    }
    for name, docs in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "mc.yaml").write_text(_task("tiny_mc", folder / "mc.jsonl", (
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n"
        + _metric("acc", "mean", True) + _metric("acc_norm", "mean", True))))
    (folder / "ppl.yaml").write_text(_task("tiny_ppl", folder / "ppl.jsonl", (
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n"
        + _metric("word_perplexity", "weighted_perplexity", False)
        + _metric("byte_perplexity", "weighted_perplexity", False) + _metric("bits_per_byte", "bits_per_byte", False))))
    (folder / "gen.yaml").write_text(_task("tiny_gen", folder / "gen.jsonl", (
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n"
        + _metric("exact_match", "mean", True))))
    return folder


def lm_eval_hf(folder: Path, tasks: list[str], include: Path, limit: int | None = None) -> dict:
    """The oracle: lm-eval's own `hf` model (transformers' forward and generate) on `folder`."""
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=tasks,
                                   task_manager=TaskManager(include_path=str(include), include_defaults=False),
                                   device="cpu", batch_size=4, limit=limit, log_samples=True)


def assert_same_scores(ours: dict[str, float], theirs: dict, stderr: bool = True) -> None:
    """Every metric of lm-eval's results under titanite's name: accuracies exactly, the rest
    (perplexities, from summed log-probabilities) to 1e-5."""
    compared = 0
    for task, metrics in theirs["results"].items():
        for key, value in metrics.items():
            metric, comma, kept = key.partition(",")
            if not comma or isinstance(value, str) or ("_stderr" in metric and not stderr):
                continue
            assert kept == "none"
            got = ours[f"eval/{task}/{metric}"]
            if "perplexity" in metric or "bits_per_byte" in metric:
                assert got == pytest.approx(value, rel=1e-5), (task, metric)
            else:
                assert got == value, (task, metric)
            compared += 1
    assert compared >= 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    root = tmp_path_factory.mktemp("lm-eval")
    hf = make_hf_checkpoint(root / "hf", tiny_tokenizer_dir, seed=3, max_position_embeddings=MAX_POSITIONS)
    tasks = write_tasks(root / "tasks")
    return {"root": root, "hf": hf, "tasks": tasks, "oracle": lm_eval_hf(hf, TASKS, tasks)}


def test_titanite_eval_scores_equal_lm_evals_hf_model(bench):
    out = bench["root"] / "scores.json"
    proc = run_cli("eval", "--model", str(bench["hf"]), "--tasks", ",".join(TASKS), "--include-path",
                   str(bench["tasks"]), "--output", str(out), check=True)
    report = json.loads(out.read_text())
    assert_same_scores(report["scores"], bench["oracle"])
    assert "tiny_mc" in proc.stdout and "acc_norm" in proc.stdout
    ppl = bench["oracle"]["samples"]["tiny_ppl"]
    assert len(ppl) == 4 and 0 < report["scores"]["eval/tiny_ppl/bits_per_byte"]


@pytest.mark.parametrize("how", ["registered", "loop"])
def test_each_loglikelihood_and_generation_equals_lm_evals_hf_model(bench, how):
    """Request by request. `registered`: the model class titanite registers with lm-eval (native
    model, KV-cache generation); `loop`: what the training loop builds, here on the transformers
    backend (generation by full forwards)."""
    import torch
    from lm_eval.tasks import TaskManager

    import titanite.commands.eval  # noqa: F401  registers model "titanite"
    from titanite.api import load_pretrained
    from titanite.evaluation.harness import TitaniteLM, greedy_decoder

    if how == "registered":
        model, args = "titanite", f"pretrained={bench['hf']},batch_size=4"
    else:
        hf = load_pretrained(bench["hf"], spec="hf")
        model, args = TitaniteLM(hf, bench["hf"], MAX_POSITIONS, 3, greedy_decoder(hf, torch.device("cpu"), int)), None
    ours = lm_eval.simple_evaluate(model=model, model_args=args, tasks=TASKS, log_samples=True,
                                   task_manager=TaskManager(include_path=str(bench["tasks"]), include_defaults=False))
    for task in TASKS:
        theirs = sorted(bench["oracle"]["samples"][task], key=lambda s: s["doc_id"])
        mine = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs, strict=True):
            for (x,), (y,) in zip(a["resps"], b["resps"], strict=True):
                if task == "tiny_gen":
                    assert x == y  # the same greedy text, cut at the same stop sequence
                elif task == "tiny_mc":
                    assert x[0] == pytest.approx(y[0], abs=1e-5) and x[1] == y[1]
                else:
                    assert x == pytest.approx(y, abs=1e-5)


def test_in_loop_eval_tasks_log_scores_at_the_interval(bench, tmp_path, tiny_data):
    out = tmp_path / "run"
    run_cli("train", *tiny_train_args(bench["hf"], tiny_data, out, steps=4, **{
        "eval.tasks": '["tiny_mc"]', "eval.include_path": bench["tasks"], "eval.interval": 2,
        "checkpoint.interval": 0}), check=True)
    rows = read_metrics(out)
    scored = [r["step"] for r in rows if "eval/tiny_mc/acc" in r]
    assert scored == [2, 4]
    assert all("eval/tiny_mc/acc_norm" in r for r in rows if r["step"] in scored)
    oracle = lm_eval_hf(out / "hf", ["tiny_mc"], bench["tasks"])  # the weights the last evaluation saw
    assert_same_scores(rows[-1], oracle, stderr=False)

    from titanite.commands.eval import TitaniteFolderLM
    from titanite.evaluation.harness import evaluate, scores

    # --model given a run folder: its latest checkpoint, the same weights again.
    assert_same_scores(scores(evaluate(TitaniteFolderLM(str(out)), ["tiny_mc"], str(bench["tasks"]))), oracle)


def test_bad_input_is_one_message_and_exit_2(bench, tmp_path, capsys):
    from titanite.cli import main
    from titanite.core.config import load_config
    from titanite.core.errors import UserError
    from titanite.run.preflight import preflight

    def fails(*args: str) -> str:
        assert main(["eval", *args]) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    model, include = ["--model", str(bench["hf"])], ["--include-path", str(bench["tasks"])]
    err = fails(*model, "--tasks", "tiny_mcq", *include)
    assert err.startswith("titanite: error: --tasks: unknown task 'tiny_mcq'") and "did you mean 'tiny_mc'" in err
    err = fails(*model, "--tasks", "tiny_mc", "--include-path", str(tmp_path / "nowhere"))
    assert err == f"titanite: error: --include-path: {tmp_path / 'nowhere'} is not a folder"
    err = fails("--model", str(tmp_path / "missing"), "--tasks", "tiny_mc", *include)
    assert err == f"titanite: error: --model: {tmp_path / 'missing'} is not a folder"

    data = write_corpus(tmp_path / "data.jsonl")
    for extra, message in [({"eval.tasks": '["tiny_mcq"]', "eval.include_path": bench["tasks"]}, "unknown task"),
                           ({"eval.tasks": '["tiny_mc"]', "eval.include_path": tmp_path / "no"}, "is not a folder")]:
        cfg = load_config(None, tiny_train_args(bench["hf"], data, tmp_path / "run", **extra))
        with pytest.raises(UserError, match=f"eval\\.(tasks|include_path): .*{message}"):
            preflight(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_titanite_eval_of_a_qwen3_next_folder_equals_lm_evals_hf_model(bench, tiny_tokenizer_dir):
    """A hybrid model (Gated DeltaNet layers with their cache in generation): the same scores as
    lm-eval's own transformers model, generation tasks included."""
    from tests.fixtures.hybrid import make_hybrid_checkpoint

    folder = make_hybrid_checkpoint(bench["root"] / "next", "qwen3_next", max_position_embeddings=MAX_POSITIONS)
    for f in tiny_tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    out = bench["root"] / "next-scores.json"
    run_cli("eval", "--model", str(folder), "--tasks", ",".join(TASKS), "--include-path", str(bench["tasks"]),
            "--output", str(out), check=True)
    assert_same_scores(json.loads(out.read_text())["scores"], lm_eval_hf(folder, TASKS, bench["tasks"]))
