"""Does PDL (launch_pdl + gdc_wait) work inside a CUDA graph here, and what does it save between
dependent weight-streaming kernels? Chain of N kernels; kernel i streams its own W_i (independent of
the chain) and multiplies by a scalar written by kernel i-1."""
import torch, triton, triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents

@triton.jit
def _link(w_ptr, prev_ptr, out_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if MODE == 2:  # weights first, then wait for the previous kernel
        w = tl.load(w_ptr + offs, mask=offs < n, other=0.0)
        gdc_wait()
    elif MODE == 1:
        gdc_wait()
        w = tl.load(w_ptr + offs, mask=offs < n, other=0.0)
    else:
        w = tl.load(w_ptr + offs, mask=offs < n, other=0.0)
    s = tl.load(prev_ptr)
    acc = tl.sum(w.to(tl.float32) * s, axis=0)
    if MODE != 0:
        gdc_launch_dependents()
    tl.atomic_add(out_ptr, acc * 1e-9)

def main():
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for mb, nk in ((8, 6), (2, 6), (0.0625, 6)):
        n = int(mb * (1 << 20) // 2)
        ws = [torch.randn(n, dtype=torch.bfloat16, device=dev) for _ in range(nk)]
        outs = [torch.ones(1, dtype=torch.float32, device=dev) for _ in range(nk + 1)]
        block = 4096
        grid = (triton.cdiv(n, block),)
        res = {}
        for mode in (0, 1, 2):
            def chain():
                for i in range(nk):
                    _link[grid](ws[i], outs[i], outs[i + 1], n, BLOCK=block, MODE=mode, num_warps=4,
                                launch_pdl=mode != 0)
            chain(); torch.cuda.synchronize()
            reps = 20
            g = torch.cuda.CUDAGraph(); gf = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                for _ in range(reps):
                    flush.zero_(); chain()
            with torch.cuda.graph(gf):
                for _ in range(reps):
                    flush.zero_()
            ts = []
            for g_ in (g, gf):
                g_.replay(); torch.cuda.synchronize()
                e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
                vals = []
                for _ in range(7):
                    e0.record(); g_.replay(); e1.record(); torch.cuda.synchronize(); vals.append(e0.elapsed_time(e1))
                ts.append(sorted(vals)[3])
            res[mode] = (ts[0] - ts[1]) / reps * 1e3 / nk
        floor = mb * (1 << 20) / 4.1e12 * 1e6
        print(f"{mb} MB x {nk} links: per link us: plain {res[0]:.2f}  pdl-wait-first {res[1]:.2f}  "
              f"pdl-weights-first {res[2]:.2f}   (stream floor {floor:.2f})", flush=True)

main()
