#!/usr/bin/env python3
"""Writes the config.json fixtures of examples/llama/tests/fixtures/hf_config with transformers
itself, so the parser is tested on what transformers really writes. Run it once under
transformers 5 and once under transformers 4 (each writes its own v5_/v4_ files):

    python3 -m venv /tmp/tf5 && /tmp/tf5/bin/pip install transformers==5.23.0
    /tmp/tf5/bin/python scripts/make_hf_config_fixtures.py
    python3 -m venv /tmp/tf4 && /tmp/tf4/bin/pip install transformers==4.57.6
    /tmp/tf4/bin/python scripts/make_hf_config_fixtures.py

Needs no PyTorch: only the configuration classes are used.
"""
import json
import os
import sys
import tempfile

import transformers
from transformers import LlamaConfig

OUT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "examples", "llama", "tests",
                                   "fixtures", "hf_config"))

# `tiny`'s shape (examples/llama/src/config.rs).
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

V5 = {
    # The case that loaded silently wrong: the base only inside rope_parameters.
    "default_theta": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3": dict(rope_parameters={**LLAMA3, "rope_theta": 500000.0}),
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    # transformers 4's keys handed to transformers 5, which converts them.
    "from_legacy_keys": dict(rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 4.0}),
    # Llama 3.2 1B's shape and rotary settings, with its head untied (our `llama-1b` preset).
    "llama_1b_untied": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=131072, rms_norm_eps=1e-5,
                            rope_parameters={"rope_type": "llama3", "factor": 32.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192,
                                             "rope_theta": 500000.0}),
    # A head tied to the embedding, as Llama 3.2 1B and 3B.
    "tied": dict(tie_word_embeddings=True),
    # Refused, each with a sentence.
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 64}),
    "partial_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5}),
    "attention_bias": dict(attention_bias=True),
    "mlp_bias": dict(mlp_bias=True),
    "gelu": dict(hidden_act="gelu"),
    "dropout": dict(attention_dropout=0.1),
}

V4 = {
    "default": dict(rope_theta=10000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3)),
    "linear_type": dict(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}),
    "dynamic": dict(rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
}


def main():
    major = transformers.__version__.split(".")[0]
    cases = {"5": V5, "4": V4}.get(major)
    if cases is None:
        sys.exit(f"transformers {transformers.__version__}: run this under transformers 4 or 5")
    os.makedirs(OUT, exist_ok=True)
    for name, overrides in cases.items():
        config = LlamaConfig(**{**TINY, **overrides})
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            with open(os.path.join(tmp, "config.json")) as f:
                text = json.load(f)
        path = os.path.join(OUT, f"v{major}_{name}.json")
        with open(path, "w") as f:
            json.dump(text, f, indent=2, sort_keys=True)
            f.write("\n")
        print(path)


if __name__ == "__main__":
    main()
