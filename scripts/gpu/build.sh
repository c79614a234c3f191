#!/usr/bin/env bash
# GPU validation, part 1, on a machine with cargo (no GPU needed): builds everything the GPU run
# needs with `--features cuda` into gpu-bundle/ (git-ignored), stripped, with part 2 beside it.
# Copy gpu-bundle/ to a machine with one NVIDIA GPU and run `gpu-bundle/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle"

cargo build --release --features cuda -p llama -p benches --bin llama --bin adamw
cp target/release/llama target/release/adamw "$bundle"/

# The kernel tests, compared against their fallbacks on CUDA.
tests=$(cargo test --release -p burn-kernels --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["test"] and m.get("executable"):
        print(m["target"]["name"], m["executable"])')
while read -r name path; do
    cp "$path" "$bundle/kernel-test-$name"
done <<< "$tests"

strip "$bundle"/* 2>/dev/null || true
cp scripts/gpu/run.sh scripts/gpu/torch_llama.py "$bundle"/
du -sh "$bundle"
ls "$bundle"
