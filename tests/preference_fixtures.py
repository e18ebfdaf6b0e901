"""What the preference (DPO) tests share: a tiny chat tokenizer, tiny policy/reference checkpoints
(dense and MoE), pair data in TRL's two forms, and TRL itself as the oracle.

Oracles
-------
- `trl_dpo` runs `trl.DPOTrainer` (TRL 1.16) on CPU in fp32 with the whole data set as one batch
  and returns its logged metrics per optimizer step. Every setting that decides the numbers is
  pinned to what a titanite run is given (constant LR, no warmup, no weight decay, AdamW(0.9,
  0.999, 1e-8), clipping at 1.0, no dropout, no gradient checkpointing, right padding, keep-start
  truncation at `max_length`). One setting departs from TRL's default: `router_aux_loss_coef=0.0`.
  TRL adds the MoE load-balancing loss whenever the config declares a coefficient (Qwen3-MoE's
  library default is 0.001), while titanite (like transformers) adds it only when config.json
  turns `output_router_logits` on, which these checkpoints do not; the test compares the
  preference loss, so the auxiliary term is left out on the TRL side.
- `trl_simpo`: TRL 1.16's DPOTrainer has no 'simpo'; TRL defines SimPO in its CPO trainer
  (`trl.experimental.cpo.CPOTrainer`, `loss_type="simpo"`, `cpo_alpha=0` for pure SimPO,
  log-probs averaged over the completion tokens, rewards = beta x that average, no reference).
  CPOTrainer itself is the oracle: its forward, loss (`cpo_loss`), metrics and training loop are
  TRL's. Only its tokenization is replaced (`tokenize_row`), by DPOTrainer's, which is what
  titanite follows. CPO's own tokenization gives the same ids for standard-form rows whose
  prompt tokenizes as a prefix of prompt+completion (checked on every call), but differs
  elsewhere: for conversational rows CPO renders the template to text and appends an EOS after
  the rendered `<|im_end|>\\n`, a token DPOTrainer (and titanite) do not train on; where the
  prompt's last token merges with a completion, CPO steps each completion back on its own
  while DPO starts both at the earlier divergence.
- `dpo_tokenize` restates DPOTrainer's tokenization independently (prompt ids, then the
  completion from where the tokenized prompt and prompt+completion diverge; EOS appended to
  standard-form completions; the chat template's `<|im_end|>\\n` ends conversational ones);
  `test_preference_trl.py` checks it against the ids DPOTrainer builds, and the oracle's losses
  against a hand computation from transformers forwards on those ids.

TRL runs in-process, a second or two a run: each run's output folder is removed after it, and
torch's thread count, the environment and accelerate's process state are put back, so the other
tests in the process see nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import torch

from tests.chat_fixtures import TOY_QA, write_jsonl
from tests.conftest import TINY_MOE, make_hf_checkpoint

POLICY_SEED, REFERENCE_SEED = 0, 1
POLICY_INIT, REFERENCE_INIT = 0.1, 0.5
KINDS = {"dense": {}, "moe": TINY_MOE}
MAX_LENGTH = 96  # longer than every pair below: no truncation unless a test asks for it
STEP_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected")

SYSTEM = "answer in one word."
# Wrong answers, and longer right/wrong ones, so completions differ in length and pad. The chosen
# completions are mostly the longer ones: the reference is the sharper model, so each completion
# token adds to the implied reward, and the mean margin stays well away from 0 (where relative
# comparisons lose their meaning).
_WRONG = {"paris": "rome", "rome": "paris", "blue": "green", "green": "blue", "cold": "hot",
          "down": "up", "alpha": "omega", "dog": "cat"}
_LONG = {0: ("paris, the capital and largest city of france", "rome"),
         2: ("blue, as the sky is on a clear day", "green"),
         3: ("green", "the color of grass is red"),
         5: ("down, the opposite of up", "up"),
         7: ("dog, the animal that barks at the model", "cat")}


def _pair_texts() -> list[tuple[str, str, str]]:
    """(question, chosen answer, rejected answer) for each toy question."""
    out = []
    for i, (q, a) in enumerate(TOY_QA):
        chosen, rejected = _LONG.get(i, (a, _WRONG[a]))
        out.append((q, chosen, rejected))
    return out


def standard_pairs() -> list[dict]:
    """TRL's standard form: plain-text prompt and completions (DPOTrainer appends the EOS). In the
    last two rows the prompt ends mid-word: " token" + "s" tokenizes as " tokens", so the tokenized
    prompt is not a prefix of prompt+completion and the completion starts where they diverge
    (for both completions in the first of them, for the rejected one only in the second, where
    the earlier divergence decides for both). The last row's prompt is chat markup."""
    rows = [{"prompt": f"question: {q}\nanswer:", "chosen": f" {c}", "rejected": f" {r}"}
            for q, c, r in _pair_texts()]
    rows.append({"prompt": "the model reads token", "chosen": "s and predicts the next token", "rejected": "s"})
    rows.append({"prompt": "the optimizer lowers the loss on every token", "chosen": " of training data",
                 "rejected": "s"})
    # chat markup written into a standard-form prompt: its special tokens are single ids, as
    # transformers' tokenizer parses them (a completion ending in the EOS text gets no second one)
    rows.append({"prompt": "<|im_start|>user\nopposite of hot?<|im_end|>\n<|im_start|>assistant\n",
                 "chosen": "cold<|im_end|>", "rejected": "warm, rather"})
    return rows


def conversational_pairs() -> list[dict]:
    """TRL's conversational form: message lists, some with a system message first, one with an
    earlier exchange in the prompt."""
    rows = []
    for i, (q, c, r) in enumerate(_pair_texts()):
        prompt = [{"role": "user", "content": q}]
        if i % 3 == 0:
            prompt.insert(0, {"role": "system", "content": SYSTEM})
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": c}],
                     "rejected": [{"role": "assistant", "content": r}]})
    rows.append({"prompt": [{"role": "user", "content": "color of grass?"}, {"role": "assistant", "content": "green"},
                            {"role": "user", "content": "and of the sky?"}],
                 "chosen": [{"role": "assistant", "content": "blue"}],
                 "rejected": [{"role": "assistant", "content": "green as well"}]})
    return rows


FORMS = {"standard": standard_pairs, "conversational": conversational_pairs}


# -- models and data -----------------------------------------------------------------------------


def make_pair_models(root: Path, tokenizer_dir: Path) -> dict[str, tuple[Path, Path]]:
    """kind -> (policy, reference) folders: same architecture, the tokenizer in both, different
    weights. The reference is drawn at a larger scale (initializer_range 0.5 against the
    policy's 0.1), so it is the sharper model and the log-ratios are far from 0."""
    out = {}
    for kind, kw in KINDS.items():
        out[kind] = (make_hf_checkpoint(root / f"{kind}-policy", tokenizer_dir, seed=POLICY_SEED,
                                        initializer_range=POLICY_INIT, **kw),
                     make_hf_checkpoint(root / f"{kind}-reference", tokenizer_dir, seed=REFERENCE_SEED,
                                        initializer_range=REFERENCE_INIT, **kw))
    return out


def write_pair_data(root: Path) -> dict[str, Path]:
    """form -> a JSON-lines file of its pairs."""
    root.mkdir(parents=True, exist_ok=True)
    return {form: write_jsonl(root / f"{form}.jsonl", make()) for form, make in FORMS.items()}


# -- tokenization, restated ---------------------------------------------------------------------


def load_tokenizer(tokenizer_dir: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share (os.path.commonprefix works on any sequences)."""
    return len(os.path.commonprefix([a, b]))


def dpo_tokenize(tok, row: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) as DPOTrainer builds them, before truncation."""
    if isinstance(row["prompt"], list):
        def ids(messages, **kw):
            return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])

        prompt = ids(row["prompt"], add_generation_prompt=True)
        full_c, full_r = ids(row["prompt"] + row["chosen"]), ids(row["prompt"] + row["rejected"])
    else:
        eos = tok.eos_token
        prompt = tok(row["prompt"])["input_ids"]
        full_c = tok(row["prompt"] + row["chosen"] + ("" if row["chosen"].endswith(eos) else eos))["input_ids"]
        full_r = tok(row["prompt"] + row["rejected"] + ("" if row["rejected"].endswith(eos) else eos))["input_ids"]
    n = min(_common_prefix(prompt, full_c), _common_prefix(prompt, full_r))
    return prompt[:n], full_c[n:], full_r[n:]


def padded_pairs(tok, rows: list[dict], max_length: int = MAX_LENGTH):
    """DataCollatorForPreference's batch, restated: [chosen rows; rejected rows], each sequence
    prompt+completion cut to `max_length` (keep the start), right-padded with the pad id.
    Returns (input_ids, attention_mask, completion_mask)."""
    seqs, masks = [], []
    tokenized = [dpo_tokenize(tok, r) for r in rows]
    for which in (1, 2):
        for t in tokenized:
            seqs.append((t[0] + t[which])[:max_length])
            masks.append(([0] * len(t[0]) + [1] * len(t[which]))[:max_length])
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    comp = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], attn[i, :len(s)], comp[i, :len(m)] = torch.tensor(s), 1, torch.tensor(m)
    return ids, attn, comp


def completion_logps(model, ids, attn, comp) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (sum, mean) log-probability of the completion tokens under a transformers
    model's own forward (its full logits, no fused head)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target = ids[:, 1:]
    mask = comp[:, 1:].to(logits.dtype)
    per_token = torch.gather(logits.log_softmax(-1), 2, target.unsqueeze(-1)).squeeze(-1) * mask
    total = per_token.sum(1)
    return total, total / mask.sum(1).clamp(min=1)


def transformers_causal_lm(folder: Path):
    """transformers' model of a folder, fp32, SDPA attention, eager experts."""
    import transformers

    kw = {"experts_implementation": "eager"} if "num_experts" in json.loads((folder / "config.json").read_text()) else {}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="sdpa", **kw)


# -- the TRL runs --------------------------------------------------------------------------------


def _training_args(cls, out: Path, rows: list[dict], steps: int, lr: float, max_length: int, **extra):
    return cls(output_dir=str(out), per_device_train_batch_size=len(rows), gradient_accumulation_steps=1,
               max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
               weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
               optim="adamw_torch", bf16=False, fp16=False, use_cpu=True, activation_checkpointing=False,
               logging_steps=1, report_to="none", save_strategy="no", seed=0, data_seed=0,
               disable_dropout=True, max_length=max_length, dataloader_drop_last=False,
               dataloader_num_workers=0, remove_unused_columns=False, **extra)


def _step_log():
    """A TrainerCallback keeping each logged training row (logging_steps=1: one row per step)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        rows: list[dict]

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.rows.append({"step": state.global_step, **logs})

    log = StepLog()
    log.rows = []
    return log


@contextlib.contextmanager
def _trl_sandbox(prefix: str):
    """A scratch output folder, removed after; torch's thread count, the environment and
    accelerate's process state put back as they were, so other tests in this process see none
    of the run."""
    threads, env = torch.get_num_threads(), dict(os.environ)
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as out:
            yield Path(out)
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()


def _pick(rows: list[dict], steps: int) -> list[dict]:
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    return [{"step": r["step"], **{k: float(r[k]) for k in STEP_METRICS}} for r in rows]


def run_trl_dpo(policy: Path, reference: Path, tokenizer_dir: Path, rows: list[dict], *, loss_type: str,
                beta: float, label_smoothing: float = 0.0, sft_weight: float = 0.0, steps: int, lr: float,
                max_length: int = MAX_LENGTH, precompute: bool = False, discopop_tau: float = 0.05
                ) -> tuple[list[dict], list[tuple[list[int], list[int], list[int]]]]:
    """`trl_dpo`, and DPOTrainer's tokenized rows [(prompt_ids, chosen_ids, rejected_ids)]."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    losses, weights = ([loss_type, "sft"], [1.0, sft_weight]) if sft_weight else ([loss_type], None)
    with _trl_sandbox("trl-dpo-") as out:
        args = _training_args(DPOConfig, out, rows, steps, lr, max_length, beta=beta, loss_type=losses,
                              loss_weights=weights, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                              precompute_ref_log_probs=precompute, router_aux_loss_coef=0.0,
                              truncation_mode="keep_start", pad_to_multiple_of=None)
        log = _step_log()
        trainer = DPOTrainer(model=transformers_causal_lm(policy), ref_model=transformers_causal_lm(reference),
                             args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=load_tokenizer(tokenizer_dir), callbacks=[log])
        tokenized = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
        trainer.train()
    return _pick(log.rows, steps), tokenized


def trl_dpo(policy: Path, reference: Path, tokenizer_dir: Path, rows: list[dict], *, loss_type: str, beta: float,
            label_smoothing: float = 0.0, sft_weight: float = 0.0, steps: int, lr: float,
            max_length: int = MAX_LENGTH, precompute: bool = False, discopop_tau: float = 0.05) -> list[dict]:
    """`trl.DPOTrainer` on `rows` as one batch for `steps` optimizer steps: per step, {step, loss,
    grad_norm, rewards/*, logps/*} as TRL logs them. `sft_weight` > 0 trains on
    loss_type=[loss_type, "sft"] with loss_weights=[1, sft_weight]."""
    return run_trl_dpo(policy, reference, tokenizer_dir, rows, loss_type=loss_type, beta=beta,
                       label_smoothing=label_smoothing, sft_weight=sft_weight, steps=steps, lr=lr,
                       max_length=max_length, precompute=precompute, discopop_tau=discopop_tau)[0]


def _cpo_on_dpo_tokens():
    """CPOTrainer with DPOTrainer's tokenization (see the module docstring)."""
    from trl.experimental.cpo import CPOTrainer

    class CPOOnDPOTokens(CPOTrainer):
        def tokenize_row(self, feature, model=None):
            batch = {}
            prompt = feature["dpo_prompt_ids"]
            batch["prompt_input_ids"], batch["prompt_attention_mask"] = prompt, [1] * len(prompt)
            for side in ("chosen", "rejected"):
                ids = (prompt + feature[f"dpo_{side}_ids"])[:self.max_length]
                labels = ([-100] * len(prompt) + feature[f"dpo_{side}_ids"])[:self.max_length]
                batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"] = ids, [1] * len(ids)
                batch[f"{side}_labels"] = labels
            if feature.get("check_cpo_tokens"):  # standard form: CPO's own tokenization agrees
                own = super().tokenize_row({k: feature[k] for k in ("prompt", "chosen", "rejected")}, model)
                for k in ("chosen_input_ids", "rejected_input_ids", "chosen_labels", "rejected_labels"):
                    assert own[k] == batch[k], (k, own[k], batch[k])
            return batch

    return CPOOnDPOTokens


def trl_simpo(policy: Path, tokenizer_dir: Path, rows: list[dict], *, beta: float, simpo_gamma: float = 0.5,
              label_smoothing: float = 0.0, steps: int, lr: float, max_length: int = MAX_LENGTH) -> list[dict]:
    """TRL's SimPO: `CPOTrainer(loss_type="simpo", cpo_alpha=0)` on DPOTrainer's tokenization of
    `rows`, as one batch for `steps` optimizer steps. logps/* are the mean per-token log-probs of
    the completions and rewards/* beta x those (TRL CPO's meaning)."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig

    tok = load_tokenizer(tokenizer_dir)
    data = []
    for r in rows:
        p, c, rej = dpo_tokenize(tok, r)
        # CPO's own ids are DPO's for standard-form rows whose prompt tokenizes as a prefix of both
        # prompt+completions (CPO steps back per completion, DPO to the earlier divergence of the
        # two) and that need no truncation (CPO truncates the completion only).
        agree = (not isinstance(r["prompt"], list) and p == tok(r["prompt"])["input_ids"]
                 and len(p) + max(len(c), len(rej)) <= max_length)
        data.append({**r, "dpo_prompt_ids": p, "dpo_chosen_ids": c, "dpo_rejected_ids": rej,
                     "check_cpo_tokens": agree})
    with _trl_sandbox("trl-simpo-") as out:
        args = _training_args(CPOConfig, out, rows, steps, lr, max_length, beta=beta, loss_type="simpo",
                              cpo_alpha=0.0, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing)
        log = _step_log()
        trainer = _cpo_on_dpo_tokens()(model=transformers_causal_lm(policy), args=args,
                                       train_dataset=Dataset.from_list(data), processing_class=tok, callbacks=[log])
        trainer.train()
    return _pick(log.rows, steps)


# -- comparing -----------------------------------------------------------------------------------


def rel_diff(ours: float, theirs: float, floor: float = 0.1) -> float:
    """|ours - theirs| / max(|theirs|, floor): relative, with an absolute floor for values near 0
    (rel 1e-5 against a floor of 0.1 is 1e-6 absolute)."""
    return abs(ours - theirs) / max(abs(theirs), floor)

