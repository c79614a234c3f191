#!/usr/bin/env python3
"""PyTorch eager training of the same Llama shape as `llama train --model NAME`: the peer
reference for the GPU bench. The model follows Hugging Face's LlamaForCausalLM (RMSNorm,
rotate-half rotary embeddings, grouped-query causal attention, SwiGLU, untied head), trained
with AdamW on uniformly random tokens (the speed does not depend on the data). Prints one JSON
line: tokens/s (median step), peak memory, parameters and MFU against the fp32 peak given.

    torch_llama.py --model small --batch-size 16 --seq-len 256 --steps 30 --peak-tflops 67
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# vocab, hidden, intermediate, layers, heads, kv heads: examples/llama/src/config.rs.
PRESETS = {
    "tiny": (256, 128, 512, 4, 4, 2),
    "small": (256, 512, 1408, 8, 8, 4),
}


class Block(torch.nn.Module):
    def __init__(self, hidden, inter, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.q, self.k, self.v = lin(hidden, hidden), lin(hidden, kv_heads * self.head_dim), lin(hidden, kv_heads * self.head_dim)
        self.o = lin(hidden, hidden)
        self.gate, self.up, self.down = lin(hidden, inter), lin(hidden, inter), lin(inter, hidden)
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5), torch.nn.RMSNorm(hidden, eps=1e-5)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        # Eager attention, as burn's model computes it (no fused flash kernel).
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)
        attn = torch.softmax(scores + mask, dim=-1) @ v
        x = x + self.o(attn.transpose(1, 2).reshape(b, n, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Llama(torch.nn.Module):
    def __init__(self, vocab, hidden, inter, layers, heads, kv_heads):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, inter, heads, kv_heads) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head_dim = hidden // heads
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        n = ids.shape[1]
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.head_dim, 2, device=ids.device) / self.head_dim)
        angles = torch.outer(torch.arange(n, device=ids.device, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small", choices=PRESETS)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's fp32 peak, for MFU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    # Plain fp32, as burn runs it: no TF32 tensor cores.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    device = torch.device(args.device)
    vocab = PRESETS[args.model][0]
    model = Llama(*PRESETS[args.model]).to(device)
    params = sum(p.numel() for p in model.parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps + 2):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device=device)
        sync()
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sync()
        if step >= 2:
            times.append(time.perf_counter() - start)
    tokens = args.batch_size * args.seq_len
    tokens_per_s = tokens / statistics.median(times)
    flops_per_token = 6 * params
    result = {
        "framework": f"pytorch {torch.__version__} eager",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": args.model,
        "parameters": params,
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "peak_memory_mb": round(torch.cuda.max_memory_allocated() / 1e6, 1) if device.type == "cuda" else None,
        "mfu": round(tokens_per_s * flops_per_token / (args.peak_tflops * 1e12), 4) if args.peak_tflops else None,
        "final_loss": round(loss.item(), 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
