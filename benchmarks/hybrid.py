"""Training step of a Qwen3.5-shaped hybrid model: titanite's native model against transformers'
own (`Qwen3_5ForCausalLM` with its pure-PyTorch Gated DeltaNet fallbacks), same CPU, same batch.

A ~25M-parameter Qwen3.5 text model (hidden 256, 8 layers: 3 Gated DeltaNet per gated
attention layer, 4 query / 2 key-value heads of 64, linear key heads 4 / value heads 8 of 32,
MLP 768, a 32,000-row vocabulary) trains on batches of B x S tokens (fp32). Each row runs in
its own process (peak RSS is the process's own); the rows alternate round by round and a row's
time is its fastest step (noise only ever adds time).

- transformers: a plain loop around the unmodified model (forward, fp32 cross-entropy,
  backward, AdamW);
- titanite native: `titanite.load_pretrained` of the same folder, its forward with labels (the
  `loss` op, which never holds the logits at once), backward, the same AdamW.

    .venv/bin/python benchmarks/hybrid.py                  # B=4, S=512
    .venv/bin/python benchmarks/hybrid.py --batch 2 --seq 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096,
              tie_word_embeddings=False)


def make_folder(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG)).save_pretrained(folder)
    return folder


def child(row: str, folder: str, batch: int, seq: int, steps: int) -> dict:
    """Run `steps` training steps of one row; the fastest step's time and the peak RSS."""
    torch.manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq))
    labels = torch.roll(ids, -1, dims=1)
    if row == "transformers":
        import transformers

        model = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32)

        def loss_fn() -> torch.Tensor:
            logits = model(input_ids=ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    else:
        sys.path.insert(0, str(REPO))
        import titanite

        model = titanite.load_pretrained(folder, spec="qwen3")

        def loss_fn() -> torch.Tensor:
            return model(ids, labels=labels)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(loss) / labels.numel())
    return {"row": row, "step_s": min(times[1:] or times), "first_loss": losses[0],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2, help="processes per row, alternating")
    parser.add_argument("--steps", type=int, default=4, help="steps per process (the first is warm-up)")
    parser.add_argument("--child", nargs=2, metavar=("ROW", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.batch, args.seq, args.steps)))
        return
    rows = ("transformers", "titanite native")
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp) / "model")
        for _ in range(args.rounds):
            for row in rows:
                out = subprocess.run([sys.executable, __file__, "--child", row, str(folder), "--batch", str(args.batch),
                                      "--seq", str(args.seq), "--steps", str(args.steps)],
                                     capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                if row not in best or result["step_s"] < best[row]["step_s"]:
                    best[row] = {**result, "peak_rss_mib": min(result["peak_rss_mib"],
                                                               best.get(row, result)["peak_rss_mib"])}
    tokens = args.batch * args.seq
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}; B={args.batch} S={args.seq} fp32, "
          f"fastest of {args.rounds} x {args.steps - 1} steps\n")
    print("| row | step (s) | tokens/s | peak RSS (MiB) | first loss |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        r = best[row]
        print(f"| {row} | {r['step_s']:.3f} | {tokens / r['step_s']:.0f} | {r['peak_rss_mib']:.0f} | {r['first_loss']:.4f} |")
    ratio = best["transformers"]["step_s"] / best["titanite native"]["step_s"]
    memory = best["titanite native"]["peak_rss_mib"] / best["transformers"]["peak_rss_mib"]
    print(f"\ntitanite native / transformers: {ratio:.2f}x tokens/s, {memory:.2f}x peak RSS")


if __name__ == "__main__":
    main()
