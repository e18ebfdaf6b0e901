"""Memory per GPU for chat fine-tuning a Qwen3 model, by layout: the numbers written beside
configs/qwen3-4b-instruct-2507-chat.toml.

    python benchmarks/chat_memory.py --flavor 4B-2507 --seq-len 4096 --batch-size 1

Formula (bytes per GPU; P parameters, N = dp_shard, L layers, T = batch_size x seq_len tokens):

    states      = 16 P / N          fp32 weights 4 + fp32 grads 4 + AdamW moments 8 (bf16 runs keep
                                    fp32 master weights: training.mixed_precision = "bf16" is autocast)
    gathered    = 2 x 2 P_layer     FSDP only: the bf16 copies of the current and the prefetched block
    activations = L x a x T         a = bytes one block keeps for backward per token (measured below);
                                    with activation_checkpoint = "full": L x r x T + a x T, where r is
                                    the block input (the residual stream) recomputed from
    head        = (h + 10 V) x T    the loss: h bytes per token kept for backward (measured; the fp32
                                    log-softmax, 4 V), plus at its peak in backward the bf16 logits
                                    still held (2 V) and two fp32 gradients of the logits (8 V)
    mask        = L x B x S^2       'documents' packing through SDPA with a boolean mask (1 byte a
                                    pair); flex / varlen kernels keep no such mask

a and h are measured here on CPU by recording every tensor autograd saves (storages counted
once) in one block and in the head + loss, at two sequence lengths: the difference is the
per-token cost, free of the weights autograd also keeps. Attention runs through SDPA's causal
kernel, which keeps O(S) per head (q, k, v, output, log-sum-exp), as flash attention does on GPU.
Peak use adds transient buffers (one block's activation gradients, the logits gradient) and
allocator slack: budget about 10 % on top.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from titanite.models.qwen3.flavors import get_flavor
from titanite.models.qwen3.model import Qwen3, TransformerBlock

GIB = 2**30


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while running fn()."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def per_token(fn_for_len, lengths=(256, 512)) -> float:
    a, b = (saved_bytes(lambda n=n: fn_for_len(n)) for n in lengths)
    return (b - a) / (lengths[1] - lengths[0])


def block_bytes_per_token(args, param_dtype: torch.dtype) -> float:
    torch.manual_seed(0)
    block = TransformerBlock(args, 0).to(param_dtype)
    block.attention_norm.weight.data.fill_(1)
    rope = Qwen3(args.replace(num_layers=0, vocab_size=8)).rotary

    def run(n: int) -> None:
        x = torch.randn(1, n, args.hidden_size, dtype=param_dtype, requires_grad=True)
        cos, sin = rope(torch.arange(n)[None], torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block(x, cos, sin)

    return per_token(run)


def head_bytes_per_token(args, param_dtype: torch.dtype) -> float:
    w = torch.randn(args.vocab_size, args.hidden_size, dtype=param_dtype) * 0.02
    w.requires_grad_(True)

    def run(n: int) -> None:
        h = torch.randn(1, n, args.hidden_size, dtype=param_dtype, requires_grad=True)
        labels = torch.randint(0, args.vocab_size, (n,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, w)
        F.cross_entropy(logits.float().flatten(0, 1), labels, reduction="sum")

    return per_token(run, (64, 128))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="4B-2507")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(2)
    args = get_flavor(a.flavor)
    with torch.device("meta"):
        model = Qwen3(args)
    P = sum(t.numel() for t in model.parameters())
    P_layer = sum(t.numel() for t in model.layers[0].parameters())
    L, T, S, H = args.num_layers, a.batch_size * a.seq_len, a.seq_len, args.hidden_size
    print(f"{a.flavor}: P = {P:,} parameters ({P_layer:,} per block), L = {L}, T = {T} tokens per micro-batch")

    rows = []
    for name, n_shard, dtype in [("1 GPU (no sharding)", 1, torch.float32)] + [
            (f"FSDP dp_shard={n}", n, torch.bfloat16) for n in (2, 4, 8)]:
        with contextlib.redirect_stdout(None):
            act = block_bytes_per_token(args, dtype)
            head = head_bytes_per_token(args, dtype) + 10 * args.vocab_size
        resid = H * (4 if dtype == torch.float32 else 2)
        states = 16 * P / n_shard
        gathered = 0 if n_shard == 1 else 2 * 2 * P_layer
        mask = L * a.batch_size * S * S
        for ac in ("none", "full"):
            acts = L * act * T if ac == "none" else (L * resid + act) * T
            total = states + gathered + acts + head * T
            rows.append((name, ac, states, gathered, acts, head * T, total, total + mask, act, head))
    print(f"measured: a = {rows[0][8] / 1024:.1f} KiB/token/block with fp32 parameters (autocast), "
          f"{rows[2][8] / 1024:.1f} KiB with bf16 parameters; h + 10 V = {rows[0][9] / 1024:.1f} KiB/token")
    print("| layout | activation_checkpoint | states | gathered | activations | head + loss | total (stream/pad) | total (documents, SDPA mask) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ac, states, gathered, acts, head, total, total_mask, _, _ in rows:
        print(f"| {name} | {ac} | {states / GIB:.1f} | {gathered / GIB:.1f} | {acts / GIB:.1f} | "
              f"{head / GIB:.1f} | {total / GIB:.1f} GiB | {total_mask / GIB:.1f} GiB |")


if __name__ == "__main__":
    main()
