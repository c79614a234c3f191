#!/usr/bin/env bash
# Trains `tiny` briefly, exports it, and checks that `llama eval` and an independent numpy
# implementation of Hugging Face's Llama (hf_llama_reference.py) give the same cross-entropy:
# for the export as written (sharded, with its index), for the same weights in bf16 shards
# written here, and for those under Llama 3's rotary scaling written as transformers 5 writes it
# (only `rope_parameters`), linear scaling as transformers 4 writes it (`rope_theta` and
# `rope_scaling`), and with the head tied to the embedding; and `tiny-moe`, trained with its
# experts split over 2 ranks, as Mixtral.
set -euo pipefail
# CI passes the binary its test command built (`LLAMA_BIN`): `cargo run` would build llama
# again with other features, and the next test run would build it back.
if [ -n "${LLAMA_BIN:-}" ]; then
    LLAMA_BIN=$(realpath -m -- "$LLAMA_BIN")
    if [ ! -f "$LLAMA_BIN" ] || [ ! -x "$LLAMA_BIN" ]; then
        echo "error: LLAMA_BIN=$LLAMA_BIN is not an executable llama binary" >&2
        exit 1
    fi
fi
cd "$(dirname "$0")/.."
python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet numpy
llama() {
    if [ -n "${LLAMA_BIN:-}" ]; then
        "$LLAMA_BIN" "$@"
    else
        cargo run --release --quiet -p llama -- "$@"
    fi
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# `tiny` is 4.2 MB in f32: several shards.
llama train --steps 30 --batch-size 8 --seq-len 32 \
    --save "$work/weights" --max-shard-size 1MB > /dev/null 2>&1
test -f "$work/weights/model.safetensors.index.json"
# The mixture of experts, saved without its burn record so `llama eval` reads the safetensors.
llama train --model tiny-moe --ep 2 --steps 30 --batch-size 8 \
    --seq-len 32 --save "$work/moe" > /dev/null 2>&1
rm "$work/moe/model.mpk"
grep -q '"model_type": "mixtral"' "$work/moe/config.json"
python3 - "$work/tokens.txt" <<'PY'
import random, sys
random.seed(7)
with open(sys.argv[1], "w") as f:
    for n in (5, 17, 33, 64):
        f.write(" ".join(str(random.randrange(16)) for _ in range(n)) + "\n")
PY

# The trained weights barely look at positions, so a model that ignored a rotary scaling would
# still agree: the scaled variants start from `sharp`, the same weights with the attention's
# four projections multiplied by 8, so attention, and with it position, moves the loss. It is
# written here in bf16, in two shards with an index and no burn record, so `llama eval` reads
# them (the export above it reads through its burn record).
mkdir "$work/sharp"
cp "$work/weights/config.json" "$work/sharp/"
python3 - "$work/weights" "$work/sharp" <<'PY'
import json, os, struct, sys
import numpy as np
sys.path.insert(0, "scripts")
from hf_llama_reference import read_weights
w = read_weights(sys.argv[1])
out = sys.argv[2]

def bf16(x):
    """Rounded to the nearest bf16, ties to even, as the top half of an f32."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")

def write(path, tensors):
    header, offset = {}, 0
    for name, data in tensors:
        header[name] = {"dtype": "BF16", "shape": list(data.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, data in tensors:
            f.write(data.tobytes())

names = sorted(w)
for name in names:
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
        w[name] = w[name] * 8
halves = [names[: len(names) // 2], names[len(names) // 2:]]
weight_map = {}
for i, half in enumerate(halves):
    shard = f"model-{i + 1:05}-of-00002.safetensors"
    write(os.path.join(out, shard), [(name, bf16(w[name])) for name in half])
    weight_map.update({name: shard for name in half})
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
PY
# `sharp` with another rotary setting in config.json: $1 the variant, $2 a Python expression
# that edits the config dict `c`.
variant() {
    cp -r "$work/sharp" "$work/$1"
    python3 - "$work/$1/config.json" "$2" <<'PY'
import json, sys
path, edit = sys.argv[1], sys.argv[2]
c = json.load(open(path))
for key in ("rope_theta", "rope_scaling", "rope_parameters"):
    c.pop(key, None)
exec(edit)
json.dump(c, open(path, "w"), indent=2)
PY
}
# Llama 3's bands with a context of 16, so the 64-token lines reach all three.
variant llama3-v5 'c["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}'
variant linear-v4 'c["rope_theta"] = 10000.0; c["rope_scaling"] = {"type": "linear", "factor": 16.0}'
# The head tied to the embedding, as Llama 3.2 1B. While the files still hold the untied head,
# which transformers 4 would ignore and 5 use, `llama eval` refuses; without it, both readers
# take the embedding.
variant tied 'c["rope_theta"] = 10000.0; c["tie_word_embeddings"] = True'
if refusal=$(llama eval --weights "$work/tied" \
    --tokens "$work/tokens.txt" 2>&1); then
    echo "a tied checkpoint holding another head was read" >&2
    exit 1
fi
grep -q "different \`lm_head.weight\`" <<<"$refusal" || { echo "$refusal" >&2; exit 1; }
# Out of the index and out of its shard, rewritten without it.
python3 - "$work/tied" lm_head.weight <<'PY'
import json, os, struct, sys
folder, name = sys.argv[1:3]
index_path = os.path.join(folder, "model.safetensors.index.json")
index = json.load(open(index_path))
shard = os.path.join(folder, index["weight_map"].pop(name))
data = open(shard, "rb").read()
(length,) = struct.unpack("<Q", data[:8])
header, body = json.loads(data[8:8 + length]), data[8 + length:]
del header[name]
kept, offset, parts = {}, 0, []
for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
    start, end = entry["data_offsets"]
    kept[key] = {**entry, "data_offsets": [offset, offset + end - start]}
    parts.append(body[start:end])
    offset += end - start
text = json.dumps(kept).encode()
text += b" " * (-len(text) % 8)
open(shard, "wb").write(struct.pack("<Q", len(text)) + text + b"".join(parts))
json.dump(index, open(index_path, "w"))
PY

sharp=""
for dir in weights sharp llama3-v5 linear-v4 tied moe; do
    ours=$(llama eval --weights "$work/$dir" --tokens "$work/tokens.txt")
    theirs=$(python3 scripts/hf_llama_reference.py "$work/$dir" "$work/tokens.txt")
    echo "$dir: llama eval $ours"
    echo "$dir: reference  $theirs"
    [ "$dir" = sharp ] && sharp=$theirs
    python3 - "$dir" "$ours" "$theirs" "${sharp:-$theirs}" <<'PY'
import json, sys
name = sys.argv[1]
a, b, sharp = (json.loads(s)["mean_cross_entropy"] for s in sys.argv[2:5])
# float32 (ours) against float64 (reference): seen to agree within 1e-7 relative.
tolerance = 1e-6 * abs(b)
assert abs(a - b) <= tolerance, f"{name}: llama eval {a} vs reference {b}"
# A variant that changed nothing could not catch a model that ignored it.
if name not in ("weights", "sharp", "moe"):
    assert abs(b - sharp) > 10 * tolerance, f"{name}: the variant moves the loss by only {abs(b - sharp)}"
print(f"hf check ({name}): agree to {abs(a - b) / abs(b):.1e} relative")
PY
done
