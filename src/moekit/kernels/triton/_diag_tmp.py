# temporary diagnostic, deleted before hand-off
import sys
import torch
sys.path.insert(0, "tests")
import test_triton_gpu as G
from moekit.kernels.triton.launch import default_config, triton_fused_moe
from torch.profiler import profile, ProfilerActivity

for name, t in (("gpt-oss-20b", 1), ("gpt-oss-20b", 1024), ("qwen3-30b-a3b", 1), ("deepseek-v3-e16", 1)):
    spec = G.SPECS[name][0]
    w = G._gpu_weights(spec, seed=1)
    x, r = G._inputs(spec, t, seed=t)
    cfg = default_config(spec, t)
    fn = lambda: triton_fused_moe(x, w, r, spec=spec, config=cfg)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            rows.append((e.device_time_total / 20, e.key[:70], e.count // 20))
    rows.sort(reverse=True)
    print(f"== {name} T={t} cfg={cfg} total {sum(r[0] for r in rows):.1f} us/call, {sum(r[2] for r in rows)} kernels")
    for us, key, n in rows[:14]:
        print(f"   {us:8.1f} us  x{n}  {key}")
