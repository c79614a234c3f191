#!/usr/bin/env python3
"""Mean next-token cross-entropy of a Hugging Face Llama checkpoint, in plain numpy.

An independent reading of the format `llama eval` claims to speak: it follows the equations of
Hugging Face's LlamaForCausalLM (RMSNorm, rotate-half rotary embeddings, grouped-query causal
attention, SwiGLU, a head untied or tied to the embedding) and of transformers' rotary scalings (default, linear, llama3,
read from transformers 4's `rope_theta`/`rope_scaling` or 5's `rope_parameters`), not our Rust
code. Weights are read by its own safetensors reader (f32, f16 and bf16; one file, or shards
with `model.safetensors.index.json`). Usage:

    hf_llama_reference.py WEIGHTS_DIR TOKENS_FILE   # prints JSON like `llama eval`
"""
import json
import math
import os
import struct
import sys

import numpy as np


def read_safetensors(path):
    """A safetensors file by its format: an 8-byte little-endian header length, a JSON header
    of dtype, shape and byte offsets, then the data. bf16 is the top half of an f32."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = body[start:end]
        if entry["dtype"] == "F32":
            values = np.frombuffer(raw, dtype="<f4")
        elif entry["dtype"] == "F16":
            values = np.frombuffer(raw, dtype="<f2")
        elif entry["dtype"] == "BF16":
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            sys.exit(f"{path}: `{name}` is {entry['dtype']}, not in this reference")
        tensors[name] = values.astype(np.float64).reshape(entry["shape"])
    return tensors


def read_weights(weights_dir):
    """The single file, or every shard the index names, each tensor from its named shard."""
    index = os.path.join(weights_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(weights_dir, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    shards = {shard: read_safetensors(os.path.join(weights_dir, shard))
              for shard in set(weight_map.values())}
    return {name: shards[shard][name] for name, shard in weight_map.items()}


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def inverse_frequencies(cfg, head_dim):
    """transformers' inv_freq: transformers 4's rope_scaling wins over 5's rope_parameters, and
    the base comes from that dict, else the top level, else 10000."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        context = rope.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return np.where(wavelength < context / high, inv_freq,
                        np.where(wavelength > context / low, inv_freq / factor, blended))
    sys.exit(f"rope_type {kind} is not in this reference")


def swiglu(h, gate, up, down):
    gate, up = h @ gate.T, h @ up.T
    return (gate / (1.0 + np.exp(-gate)) * up) @ down.T


def sparse_moe(h, p, cfg):
    """Mixtral's block: each token's top-k experts by router probability, their weights
    renormalised to sum to one, their outputs summed so weighted."""
    logits = h @ p("block_sparse_moe.gate").T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg["num_experts_per_tok"]]
    weights = np.take_along_axis(probs, top, axis=-1)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(cfg["num_local_experts"]):
        rows, slot = np.nonzero(top == e)
        if len(rows) == 0:
            continue
        expert = lambda name: p(f"block_sparse_moe.experts.{e}.{name}")
        y = swiglu(h[rows], expert("w1"), expert("w3"), expert("w2"))
        out[rows] += weights[rows, slot][:, None] * y
    return out


def forward(w, cfg, ids):
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim, eps, n = hidden // heads, cfg["rms_norm_eps"], len(ids)
    inv_freq = inverse_frequencies(cfg, head_dim)
    angles = np.outer(np.arange(n), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    mask = np.triu(np.full((n, n), -np.inf), k=1)

    x = w["model.embed_tokens.weight"][ids].astype(np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name: w[f"model.layers.{i}.{name}.weight"].astype(np.float64)
        h = rms_norm(x, p("input_layernorm"), eps)
        q = (h @ p("self_attn.q_proj").T).reshape(n, heads, head_dim).transpose(1, 0, 2)
        k = (h @ p("self_attn.k_proj").T).reshape(n, kv_heads, head_dim).transpose(1, 0, 2)
        v = (h @ p("self_attn.v_proj").T).reshape(n, kv_heads, head_dim).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv_heads, axis=0), np.repeat(v, heads // kv_heads, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(n, hidden) @ p("self_attn.o_proj").T
        h = rms_norm(x, p("post_attention_layernorm"), eps)
        if cfg.get("num_local_experts"):
            x = x + sparse_moe(h, p, cfg)
        else:
            x = x + swiglu(h, p("mlp.gate_proj"), p("mlp.up_proj"), p("mlp.down_proj"))
    x = rms_norm(x, w["model.norm.weight"].astype(np.float64), eps)
    # Tied, the head is the embedding, whatever the file holds under the head's name.
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    return x @ w[head].astype(np.float64).T


def main(weights_dir, tokens_file):
    with open(f"{weights_dir}/config.json") as f:
        cfg = json.load(f)
    w = read_weights(weights_dir)
    total, count, sequences = 0.0, 0, 0
    with open(tokens_file) as f:
        for line in f:
            ids = [int(t) for t in line.split()]
            if len(ids) < 2:
                continue
            logits = forward(w, cfg, ids[:-1])
            logits = logits - logits.max(axis=-1, keepdims=True)
            log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            total -= log_probs[np.arange(len(ids) - 1), ids[1:]].sum()
            count += len(ids) - 1
            sequences += 1
    mean = total / count
    print(json.dumps({"mean_cross_entropy": mean, "perplexity": float(np.exp(mean)),
                      "predicted_tokens": count, "sequences": sequences}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
