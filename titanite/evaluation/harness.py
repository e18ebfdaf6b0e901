"""Benchmark scores through lm-evaluation-harness (lm-eval): its task definitions and metrics,
a titanite model doing the forward.

`TitaniteLM` is the lm-eval model (a `TemplateLM`). It scores requests with any function from
token ids [B, S] to logits [B, S, V], so one class serves `titanite eval` (a model loaded on one
device, generating through `titanite generate`'s KV cache) and the training loop (the trainer's
own module on either backend, sharded or not: every rank runs the same requests, so the
collectives inside the forward line up, and no weights are gathered).

Tokenization is the model folder's transformers tokenizer, used as lm-eval's `hf` model uses it:
the same context/continuation split, the same prefix token for an empty context, the same
rolling windows and left truncation to max_position_embeddings, so the two score a model alike
(log-probabilities are taken in fp32 whatever the compute dtype).

Scores are named `eval/<task>/<metric>`: lm-eval's "acc,none" becomes "acc"; a metric under a
filter other than "none" keeps it after a slash ("exact_match,strict-match" ->
"exact_match/strict-match"). Strings lm-eval reports in place of a number ("N/A") are left out.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import yaml
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from titanite.core.config import EvalConfig
from titanite.core.errors import UserError
from titanite.device.choice import rng_state, set_rng_state
from titanite.parallel import distributed

log = logging.getLogger("titanite")

Logits = Callable[[torch.Tensor], torch.Tensor]  # int64 [B, S] on the device -> logits [B, S, V]
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's `hf` model's default, for tasks that name none


@dataclass(frozen=True)
class Decoding:
    """How one generate_until request decodes: at most `max_new_tokens`, greedy at temperature 0."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0


# (prompt ids, decoding, done: generated ids -> True once a stop sequence appeared) -> new ids
Decode = Callable[[list[int], Decoding, Callable[[list[int]], bool]], list[int]]

# Generation settings a titanite decoder follows; any other key in a task's generation_kwargs
# would change what the task measures, so it is refused rather than ignored.
_GEN_KEYS = {"until", "do_sample", "temperature", "top_p", "max_gen_toks", "max_new_tokens", "max_tokens",
             "max_completion_tokens"}


def decoding(gen_kwargs: dict[str, Any], task: str) -> tuple[list[str], Decoding]:
    """A task's generation_kwargs -> (stop sequences, Decoding), as lm-eval normalises them.
    Raises UserError for a setting titanite's decoders do not follow."""
    unknown = sorted(set(gen_kwargs) - _GEN_KEYS)
    if unknown:
        raise UserError(f"task {task!r}: generation_kwargs {', '.join(unknown)} are not supported by titanite's "
                        f"decoding (it follows {', '.join(sorted(_GEN_KEYS))})")
    kw = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
    until = kw.pop("until", None) or []
    temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
    return list(until), Decoding(int(kw["max_gen_toks"]), temperature, float(kw.get("top_p", 1.0)))


class TitaniteLM(TemplateLM):
    """An lm-eval model whose forward is a titanite model's.

    Args:
        logits: int64 ids [B, S] on `device` -> logits [B, S, V] (any float dtype).
        tokenizer_folder: the folder transformers' AutoTokenizer reads (tokenizer.json and
            tokenizer_config.json), as lm-eval's `hf` model reads the model folder.
        max_length: the longest sequence scored, in tokens (the model's max_position_embeddings).
        batch_size: requests per forward.
        decode: generation for generate_until tasks; None = none (such tasks are refused).
        device: where the ids go.
    """

    def __init__(self, logits: Logits, tokenizer_folder: str | Path, max_length: int, batch_size: int = 1,
                 decode: Decode | None = None, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self._logits, self._decode = logits, decode
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
        if self.tokenizer.eos_token_id is None:
            raise UserError(f"the tokenizer in {tokenizer_folder} names no eos_token (tokenizer_config.json); "
                            "lm-eval needs it to prefix empty contexts and to end generations")
        self.max_length, self.batch_size, self._device = max_length, batch_size, torch.device(device)

    # -- what lm-eval asks of a TemplateLM, as its `hf` model answers ------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id if bos is None else bos

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}  # the text carries its own BOS
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    # -- scoring -----------------------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log P(continuation | context), continuation is the greedy one) per request; the
        window is the last max_length tokens of context + continuation, as lm-eval's `hf` model
        takes it. Requests run longest first, `batch_size` at a time, right-padded."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            rows = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
            logprobs = self._logits(ids.to(self.device)).float().log_softmax(dim=-1)  # [B, S, V]
            for (_, _, cont), row, lp in zip(chunk, rows, logprobs, strict=True):
                assert 0 < len(cont) <= len(row), "a continuation longer than the window"
                lp = lp[len(row) - len(cont): len(row)]  # [n, V]: the positions that predict it
                target = torch.tensor(cont, device=lp.device)
                out.append((float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return order.get_original(out)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """log P(text) over disjoint windows of max_length tokens, the first conditioned on the
        prefix token (lm-eval's perplexity tasks)."""
        windows, counts = [], []
        for (text,) in (r.args for r in requests):
            tokens = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1)
            found = [(None, ctx, cont) for ctx, cont in map(make_disjoint_window, tokens)]
            windows += found
            counts.append(len(found))
        scores = iter(self._loglikelihood_tokens(windows))
        return [sum(next(scores)[0] for _ in range(n)) for n in counts]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Text generated after each context until a stop sequence (the task's `until`, and
        the end-of-text token) or max_gen_toks, with the stop sequence cut off."""
        if self._decode is None:
            raise UserError(f"task {requests[0].task_name!r} generates text, which this evaluation cannot do")
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            until, how = decoding(gen_kwargs, request.task_name)
            until = handle_stop_sequences(until, eos=eos)
            if how.max_new_tokens >= self.max_length:
                raise UserError(f"task {request.task_name!r}: max_gen_toks {how.max_new_tokens} leaves no room for the "
                                f"context in the model's {self.max_length} positions")
            special = {"add_special_tokens": False} if has_bos_prefix(context, self.tokenizer.bos_token) else {}
            prompt = self.tokenizer.encode(context, **special)[-(self.max_length - how.max_new_tokens):]

            def done(ids: list[int]) -> bool:
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
                return any(s and s in text for s in until)

            new = self._decode(prompt, how, done)
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out


def greedy_decoder(logits: Logits, device: torch.device, agree: Callable[[int], int]) -> Decode:
    """Decoding through full forwards (no KV cache), for a model that is sharded or of any
    backend. Every rank must pick the same token, or the ranks would run different numbers of
    forwards: `agree` makes them (e.g. the smallest over the ranks). Greedy only."""
    @torch.no_grad()
    def decode(prompt: list[int], how: Decoding, done: Callable[[list[int]], bool]) -> list[int]:
        assert how.temperature == 0, "sampled tasks are refused before training (load_tasks)"
        new: list[int] = []
        while len(new) < how.max_new_tokens:
            ids = torch.tensor([prompt + new], device=device)
            new.append(agree(int(logits(ids)[0, -1].argmax())))
            if done(new):
                break
        return new
    return decode


# -- tasks ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _manager(include_path: str, defaults: bool) -> TaskManager:
    # Indexing lm-eval's own ~15,000 task definitions takes ~15 s, so it is done only when a
    # named task is not under the include path, and once per process.
    return TaskManager(include_path=include_path or None, include_defaults=defaults)


def task_manager(tasks: Sequence[str], include_path: str = "", key: str = "--tasks") -> TaskManager:
    """The lm-eval TaskManager that knows every name in `tasks`: the include path's own when it
    defines them all, else lm-eval's tasks with the include path's added (which take
    precedence). Raises UserError for a missing include path or an unknown name."""
    include_key = "eval.include_path" if key == "eval.tasks" else "--include-path"
    notes = logging.getLogger("lm_eval")
    if notes.level == logging.NOTSET:  # its notes on every task loaded, unless the user set its level
        notes.setLevel(logging.WARNING)
    if include_path:
        if not Path(include_path).expanduser().is_dir():
            raise UserError(f"{include_key}: {include_path} is not a folder")
        local = _manager(str(Path(include_path).expanduser()), False)
        if set(tasks) <= set(local.all_tasks):
            return local
    manager = _manager(str(Path(include_path).expanduser()) if include_path else "", True)
    unknown = [t for t in tasks if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        where = f"lm-eval's tasks or the YAML files under {include_path}" if include_path else (
            f"lm-eval's tasks (local task definitions: {include_key})")
        hints = {t: difflib.get_close_matches(t, manager.all_tasks, n=1) for t in unknown}
        named = ", ".join(f"{t!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for t, h in hints.items())
        raise UserError(f"{key}: unknown task {named}: not in {where}")
    return manager


def load_tasks(tasks: Sequence[str], include_path: str = "", key: str = "--tasks",
               sampling: bool = True) -> dict[str, Any]:
    """Load every task (its definition and its data) as lm-eval will, so that a bad name, a
    missing data file or an unsupported generation setting (with `sampling` False: a sampled
    one) stops before any work. Returns lm-eval's {"tasks": {name: Task}, "groups": ...}."""
    manager = task_manager(tasks, include_path, key)
    try:
        loaded = manager.load(list(tasks))
    except (KeyError, OSError, ValueError, ImportError, yaml.YAMLError) as e:
        raise UserError(f"{key}: cannot load {', '.join(tasks)}: {type(e).__name__}: {e}") from e
    for name, task in loaded["tasks"].items():
        if task.get_config("output_type") == "generate_until":
            how = decoding(task.get_config("generation_kwargs") or {}, name)[1]
            if how.temperature > 0 and not sampling:
                raise UserError(f"{key}: task {name!r} samples (temperature {how.temperature:g}); generation in "
                                "the training loop is greedy: score it with titanite eval on a checkpoint")
    return loaded


def evaluate(lm: TitaniteLM, tasks: Sequence[str], include_path: str = "", limit: int = 0,
             bootstrap_iters: int = 100000) -> dict[str, Any]:
    """lm-eval's simple_evaluate of `lm` on `tasks` (its seeds, few-shot defaults and metrics).
    Returns its results dict; on a process whose LOCAL_RANK is not 0, lm-eval returns none and
    this returns {}."""
    manager = task_manager(tasks, include_path)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit or None,
                           log_samples=False, bootstrap_iters=bootstrap_iters) or {}


def scores(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's results -> {"eval/<task>/<metric>": value} (module docstring)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, kept = key.partition(",")
            if not comma or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # "alias", "sample_len" (not metrics), "N/A" where no stderr was computed
            out[f"eval/{task}/{metric if kept in ('', 'none') else f'{metric}/{kept}'}"] = float(value)
    return out


class LoopBenchmarks:
    """`eval.tasks` during training, on the trainer's own module.

    Every rank runs lm-eval on the same requests in the same order (a sharded forward is a
    collective, so all ranks must take part in each), generated tokens are agreed on with
    `agree`, and rank 0's scores are shared with the others, so every rank returns the same row.

    Args:
        e: the [eval] section (tasks, include_path, limit).
        logits: the trainer's forward, ids [B, S] -> full logits [B, S, V].
        tokenizer_folder, max_length, batch_size, device: as for TitaniteLM.
        agree: an int -> the same int on every rank (e.g. the smallest over the ranks).
    """

    def __init__(self, e: EvalConfig, logits: Logits, tokenizer_folder: Path, max_length: int, batch_size: int,
                 device: torch.device, agree: Callable[[int], int]) -> None:
        self.tasks, self.include_path, self.limit = list(e.tasks), e.include_path, e.limit
        self.device = device
        self.lm = TitaniteLM(logits, tokenizer_folder, max_length, batch_size,
                             greedy_decoder(logits, device, agree), device)

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float]:
        """Every task's scores, `eval/<task>/<metric>`. `model` is in eval mode meanwhile."""
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with own_rng(self.device):  # lm-eval seeds the global generators
                results = evaluate(self.lm, self.tasks, self.include_path, self.limit, bootstrap_iters=0)
        finally:
            model.train(was_training)
        found = json.loads(distributed.gather_texts(json.dumps(scores(results)))[0])  # rank 0's
        log.info("eval: %s (%.1f s)", ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in found.items()),
                 time.perf_counter() - start)
        return found


@contextlib.contextmanager
def own_rng(device: torch.device) -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's global generators (the host's and the
    device's); inside this, whatever it does to them is undone on the way out, so a training
    run's random streams go on as if it had not run."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state(), rng_state(device)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if saved[3] is not None:
            set_rng_state(device, saved[3])
