#!/usr/bin/env bash
# Issue 12 item 1: fxpipe.compile in a script with no main guard, launched as a file, on stdin and with
# python -c, each with an empty calibration cache and the default costs. Prints exit code, wall time,
# cache files written and the script's own line (loss, plan, cost source).
# Run: bash benchmarks/launch_styles.sh   (from the repository root, with fxpipe installed)
set -uo pipefail
work=$(mktemp -d)
cat > "$work/user.py" <<'PY'
import time, torch, fxpipe
start = time.perf_counter()
model, example_inputs = fxpipe.models.build("gpt-mini")
entry = fxpipe.models.get("gpt-mini")
pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=8, plan="auto")
opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
inputs, targets = entry.make_batch(8, seed=0)
loss = pipe.step(inputs, targets); opt.step()
print(f"loss {loss:.3f} plan {pipe.plan.layout} cost_source {pipe.plan.predicted.cost_source} in {time.perf_counter() - start:.1f} s")
PY
cd "$work"
unset FXPIPE_COSTS
for style in file stdin dash-c; do
  export FXPIPE_CACHE_DIR="$work/cache-$style"
  start=$(date +%s.%N)
  case $style in
    file) out=$(python user.py 2>&1) ;;
    stdin) out=$(python - < user.py 2>&1) ;;
    dash-c) out=$(python -c "$(cat user.py)" 2>&1) ;;
  esac
  rc=$?
  end=$(date +%s.%N)
  files=$(find "$FXPIPE_CACHE_DIR" -type f 2>/dev/null | wc -l)
  printf '== %s: exit %d, %.1f s wall, %d calibration cache file(s) written\n' "$style" "$rc" \
    "$(python -c "print($end - $start)")" "$files"
  echo "$out" | grep -E "^loss |Error|error" | tail -3
done
