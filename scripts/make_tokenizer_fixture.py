#!/usr/bin/env python3
"""Writes examples/llama/tests/fixtures/tokenizer: a small byte-level BPE tokenizer.json trained
by Hugging Face's `tokenizers` (the Python package, the same Rust core transformers uses), in
the layout of Llama 3's (byte-level pre-tokenizer and decoder, a begin-of-text token added in
front of each encoded text), and what that package makes of a sample text, so the Rust side
is tested against it:

    python3 -m pip install tokenizers
    python3 scripts/make_tokenizer_fixture.py
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "examples", "llama", "tests",
                                    "fixtures", "tokenizer"))

CORPUS = """\
Train one burn model on many devices: data, tensor and pipeline parallelism and ZeRO.
Every strategy is proven against the single-device run, step by step, loss by loss.
The tokenizer turns text into the ids the model reads, and the ids back into text.
Pipelines cut the blocks into stages; tensor parallelism splits each matrix over ranks.
"""

# Bytes outside ASCII, runs of spaces and a blank line, which a byte-level tokenizer must keep.
SAMPLE = "Ranks train in step: déjà vu, 数据并行 and ZeRO 🚀.\n\n  Two  spaces, then a tab\tend."


def main():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|begin_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    os.makedirs(OUT, exist_ok=True)
    tokenizer.save(os.path.join(OUT, "tokenizer.json"))
    expected = {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "text": SAMPLE,
        "ids": tokenizer.encode(SAMPLE, add_special_tokens=False).ids,
        "ids_with_special_tokens": tokenizer.encode(SAMPLE).ids,
        "decoded": tokenizer.decode(tokenizer.encode(SAMPLE, add_special_tokens=False).ids),
        # What `llama eval --text` reads: each non-empty line, as `tokenizer(line)` encodes it.
        "line_ids": [tokenizer.encode(line).ids for line in SAMPLE.splitlines() if line],
    }
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False)
        f.write("\n")
    print(OUT, expected["vocab_size"], len(expected["ids"]))


if __name__ == "__main__":
    main()
