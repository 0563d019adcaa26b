set -x
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch; print(torch.__version__, torch.cuda.is_available())"
pkg=$(mktemp -d); cp -r fxpipe "$pkg/"; cp -r passes "$pkg/fxpipe/passes"; cp -r models "$pkg/fxpipe/models"; export PYTHONPATH="$pkg"; cd "$pkg"  # the repo root on sys.path would shadow the mapped packages
python - <<'PY'
import time, torch
from torch import fx, nn
from fxpipe.passes.profile import measure_costs, time_module
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).cuda()
gm = fx.symbolic_trace(model)
x = torch.randn(256, 4096, device="cuda")
m = measure_costs(gm, (x,), batch_sizes=(256, 2048), warmup=2, repeats=5)
print("device", m.device)
for b in m.blocks: print(b.name, b.forward_s, b.backward_s)
big = m.blocks[0]
flops = 2 * 4096 * 4096 * 2048
print("block0 fwd TFLOP/s at 2048:", flops / big.forward_s.at(2048) / 1e12)
# cross-check with CUDA events
x2 = torch.randn(2048, 4096, device="cuda")
lin = model[0]
for _ in range(3): lin(x2)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); [lin(x2) for _ in range(10)]; e.record(); torch.cuda.synchronize()
print("events fwd s:", s.elapsed_time(e) / 10 / 1e3, "time_module fwd,bwd:", time_module(lin, [x2]))
PY
