#!/usr/bin/env bash
# The GPU checks issues 12 and 24 leave for a lent device, as one run that fits the device budget (about 9 minutes,
# up to 13 if the compiled rows use all their time).
#
# Run on the device machine from the repository root: bash benchmarks/device_session.sh
# Everything it measures lands under $OUT (the device tool brings that folder back):
#   gpu.txt          the GPU, torch and CUDA versions
#   suite.txt        the test suite with CUDA visible (issue 12 item 4), stopped after 240 s
#   overhead-*.txt   a 1-stage fxpipe step against eager forward + backward, GPT-2 small (batch 8 x 1024) and
#                    ResNet-50 (batch 64), fp32 and bf16 autocast (item 5)
#   compiled-*.txt   the same GPT-2 small step with both sides compiled by inductor (fxpipe torch_compile=True vs
#                    torch.compile(model)), fp32 and bf16, with each side's first (compiling) step (issue 24)
#   plan-local.txt   what `fxpipe plan` predicts for gpt2-small on the visible GPU with measured costs (items 2, 6)
#   gpu_check/       cost model, saved-activation bytes and overhead (benchmarks/gpu_check.py)
# Each step has its own timeout, so one that hangs does not take the others' time.
set -u
OUT=${OUT:-/tmp/fxpipe-device}
mkdir -p "$OUT"
python -m pip install -q -e . --no-deps > "$OUT/install.txt" 2>&1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/gpu.txt" 2>&1

timeout 240 python -m pytest -q -x -p no:cacheprovider > "$OUT/suite.txt" 2>&1
echo "exit $?" >> "$OUT/suite.txt"

for autocast in none bf16; do
    timeout 60 python benchmarks/overhead.py --device cuda --model gpt2-small --batch 8 --autocast "$autocast" \
        --steps 12 > "$OUT/overhead-gpt2-small-$autocast.txt" 2>&1
    timeout 45 python benchmarks/overhead.py --device cuda --model resnet-50 --batch 64 --autocast "$autocast" \
        --steps 12 > "$OUT/overhead-resnet-50-$autocast.txt" 2>&1
done

for autocast in none bf16; do
    timeout 120 python benchmarks/overhead.py --device cuda --model gpt2-small --batch 8 --autocast "$autocast" \
        --steps 12 --torch-compile > "$OUT/compiled-gpt2-small-$autocast.txt" 2>&1
done

timeout 60 python -m fxpipe plan gpt2-small --cluster local:1 --global-batch 8 --costs measured \
    > "$OUT/plan-local.txt" 2>&1
timeout 90 python benchmarks/gpu_check.py --out "$OUT/gpu_check" > "$OUT/gpu_check.txt" 2>&1
echo "done" >> "$OUT/gpu.txt"
