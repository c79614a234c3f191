#!/usr/bin/env bash
# Trains `tiny` briefly, exports it, and checks that `llama eval` and an independent numpy
# implementation of Hugging Face's Llama (hf_llama_reference.py) give the same cross-entropy.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import numpy, safetensors" 2>/dev/null || python3 -m pip install --quiet numpy safetensors
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo run --release --quiet -p llama -- train --steps 30 --batch-size 8 --seq-len 32 \
    --save "$work/weights" > /dev/null 2>&1
python3 - "$work/tokens.txt" <<'PY'
import random, sys
random.seed(7)
with open(sys.argv[1], "w") as f:
    for n in (5, 17, 33, 64):
        f.write(" ".join(str(random.randrange(16)) for _ in range(n)) + "\n")
PY
ours=$(cargo run --release --quiet -p llama -- eval --weights "$work/weights" --tokens "$work/tokens.txt")
theirs=$(python3 scripts/hf_llama_reference.py "$work/weights" "$work/tokens.txt")
echo "llama eval:        $ours"
echo "numpy reference:   $theirs"
python3 - "$ours" "$theirs" <<'PY'
import json, sys
a, b = (json.loads(s)["mean_cross_entropy"] for s in sys.argv[1:3])
# float32 (ours) against float64 (reference): agree to about 1e-6 relative.
assert abs(a - b) <= 1e-4 * abs(b), f"llama eval {a} vs reference {b}"
print(f"hf check: agree to {abs(a - b) / abs(b):.1e} relative")
PY
