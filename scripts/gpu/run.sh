#!/usr/bin/env bash
# GPU validation, part 2, on a machine with one NVIDIA GPU (no cargo needed): runs what
# scripts/gpu/build.sh bundled and writes every result under ${OUT:-gpu-results}:
#   gpu.txt          the GPU model, driver and memory (nvidia-smi)
#   nccl.txt         the NCCL transport's collectives (1 and 2 ranks sharing the GPU) checked
#                    against the local transport
#   kernels.txt      the cubecl kernel tests on CUDA, each against its plain-burn fallback
#   llama-*.txt      the Llama example on CUDA: one device, and 2 ranks sharing the GPU, their
#                    data moved through host memory (local transport) or by NCCL (*-nccl)
#   adamw.txt        the fused AdamW kernel against burn's AdamW
#   pack.txt         the pack kernel against burn's cat
#   torch.json       PyTorch eager training the same model shape (when torch imports)
#   summary.txt      tokens/s, peak GPU memory and MFU of each training run
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-gpu-results}
mkdir -p "$out"
model=${MODEL:-small}
steps=${STEPS:-30}
shape=(--model "$model" --batch-size 16 --seq-len 256 --steps "$steps" --warmup 5)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
# Dense fp32 (non-tensor-core) peaks, for MFU: burn trains in plain fp32 here.
case "$gpu" in
    *H100*) peak=67 ;;
    *H200*) peak=67 ;;
    *A100*) peak=19.5 ;;
    *) peak=0 ;;
esac

status=0
# cudarc loads libnccl.so; the nvidia-nccl pip package ships only libnccl.so.2.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
    lib=$(find / -name 'libnccl.so*' -not -path '/proc/*' 2>/dev/null | head -1)
    if [ -n "$lib" ]; then
        links=$(mktemp -d)
        ln -s "$lib" "$links/libnccl.so"
        export LD_LIBRARY_PATH="$links:${LD_LIBRARY_PATH:-}"
        echo "NCCL: $lib" | tee -a "$out/gpu.txt"
    fi
fi
# Two ranks share the one GPU.
export NCCL_MULTI_RANK_GPU_ENABLE=1
for test in "$here"/comm-test-*; do
    echo "== $(basename "$test")" | tee -a "$out/nccl.txt"
    # Bounded: a blocking NCCL start-up that hangs must not eat the rest of the run.
    BURN_COMM_REQUIRE_GPU=1 timeout 180 "$test" --test-threads=1 2>&1 | tee -a "$out/nccl.txt" || status=1
done
for test in "$here"/kernel-test-*; do
    echo "== $(basename "$test")" | tee -a "$out/kernels.txt"
    "$test" --test-threads=1 2>&1 | tee -a "$out/kernels.txt" || status=1
done

# Peak GPU memory of a command, sampled by nvidia-smi every 100 ms (MiB).
with_memory() {
    local log=$1
    shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$log.mem" &
    local sampler=$!
    "$@" > "$log" 2>&1
    local rc=$?
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    echo "peak GPU memory: $(sort -n "$log.mem" | tail -1) MiB" >> "$log"
    return $rc
}

runs=(
    "single:"
    "ddp2:--dp 2"
    "zero1:--dp 2 --zero 1"
    "zero3:--dp 2 --zero 3"
    "tp2:--tp 2"
    "pp2:--pp 2 --grad-accum 4"
    "ddp2-nccl:--dp 2 --nccl"
    "zero3-nccl:--dp 2 --zero 3 --nccl"
    "tp2-nccl:--tp 2 --nccl"
    "tp2-sp-nccl:--tp 2 --sp --nccl"
    "tp2-sp-overlap-nccl:--tp 2 --sp --tp-overlap 2 --nccl"
    "pp2-nccl:--pp 2 --grad-accum 4 --nccl"
)
for run in "${runs[@]}"; do
    name=${run%%:*}
    flags=${run#*:}
    echo "== llama $name"
    # shellcheck disable=SC2086
    with_memory "$out/llama-$name.txt" "$here/llama" train --device cuda "${shape[@]}" $flags || status=1
    tail -4 "$out/llama-$name.txt"
done

"$here/adamw" --device cuda --json "$out/adamw.json" 2>&1 | tee "$out/adamw.txt" || status=1
"$here/pack" --device cuda --json "$out/pack.json" 2>&1 | tee "$out/pack.txt" || status=1

if python3 -c "import torch" 2>/dev/null; then
    python3 "$here/torch_llama.py" --model "$model" --batch-size 16 --seq-len 256 --steps "$steps" \
        --peak-tflops "$peak" | tee "$out/torch.json" || status=1
else
    echo "torch does not import here: no PyTorch reference" | tee "$out/torch.json"
fi

python3 - "$out" "$peak" > "$out/summary.txt" <<'PY'
import glob, json, os, re, sys
out, peak = sys.argv[1], float(sys.argv[2])
print(f"{'run':<10} {'tokens/s':>10} {'peak MiB':>9} {'MFU':>7}")
for path in sorted(glob.glob(os.path.join(out, "llama-*.txt"))):
    text = open(path).read()
    params = re.search(r"\(([\d.]+)M parameters\)", text)
    tps = re.search(r"median (\d+) tokens/s", text)
    mem = re.search(r"peak GPU memory: (\d+) MiB", text)
    if not (params and tps):
        print(f"{os.path.basename(path)[6:-4]:<10} failed")
        continue
    tps_v = float(tps.group(1))
    mfu = tps_v * 6 * float(params.group(1)) * 1e6 / (peak * 1e12) if peak else float("nan")
    print(f"{os.path.basename(path)[6:-4]:<10} {tps_v:>10.0f} {mem.group(1) if mem else '?':>9} {mfu:>7.2%}")
try:
    torch = json.loads(open(os.path.join(out, "torch.json")).read())
    print(f"{'pytorch':<10} {torch['tokens_per_s']:>10.0f} {torch['peak_memory_mb']:>9} {torch['mfu'] or float('nan'):>7.2%}")
except (ValueError, KeyError, TypeError):
    pass
PY
cat "$out/summary.txt"
exit $status
