#!/usr/bin/env bash
# GPU validation, part 1, on a machine with cargo (no GPU needed): builds everything the GPU run
# needs with `--features cuda` into gpu-bundle/ (git-ignored), stripped, with part 2 beside it.
# Copy gpu-bundle/ to a machine with one NVIDIA GPU and run `gpu-bundle/run.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle"

cargo build --release --features cuda -p llama -p benches --bin llama --bin adamw --bin pack
cp target/release/llama target/release/adamw target/release/pack "$bundle"/

# Test binaries of `cargo test --features cuda $@`, copied as $prefix-<test name>.
bundle_tests() {
    local prefix=$1
    shift
    cargo test --release --features cuda "$@" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["test"] and m.get("executable"):
        print(m["target"]["name"], m["executable"])' |
        while read -r name path; do
            cp "$path" "$bundle/$prefix-$name"
        done
}
# The kernel tests, compared against their fallbacks on CUDA.
bundle_tests kernel-test -p burn-kernels
# The NCCL transport, compared against the local transport.
bundle_tests comm-test -p burn-comm --test nccl

strip "$bundle"/* 2>/dev/null || true
cp scripts/gpu/run.sh scripts/gpu/torch_llama.py "$bundle"/
du -sh "$bundle"
ls "$bundle"
