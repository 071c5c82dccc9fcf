import sys, time, statistics
sys.path.insert(0, "benchmarks")
import torch, torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module
from bench_tp import GPT, MESHPAR_PLAN
import meshpar
from meshpar.optim import DistributedOptimizer
dims = meshpar.init_parallel()
ids = torch.randint(0, 256, (8, 1024), device="cuda")
def make(v):
    torch.manual_seed(0)
    m = GPT(256, 1024, 16, 8, 1024).to("cuda", torch.bfloat16)
    if v != "dense": m = parallelize_module(m, dims.tp_mesh, MESHPAR_PLAN)
    return m
res = {}
for name in ["dense fb", "meshpar fb", "dense step", "meshpar step DistOpt"]:
    m = make("dense" if name.startswith("dense") else "meshpar")
    opt = None
    if "step" in name:
        opt = DistributedOptimizer(m, torch.optim.AdamW, lr=1e-4) if "DistOpt" in name else torch.optim.AdamW(m.parameters(), lr=1e-4)
    def step():
        if opt: opt.zero_grad(set_to_none=True)
        else: m.zero_grad(set_to_none=True)
        F.cross_entropy(m(ids).flatten(0,1).float(), ids.flatten()).backward()
        if opt: opt.step()
    for _ in range(3): step()
    ts=[]
    for _ in range(10):
        torch.cuda.synchronize(); t=time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter()-t)
    res[name]=statistics.median(ts)*1e3
for k,v in res.items(): print(f"{k:28s} {v:8.2f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    m = make("meshpar"); opt = DistributedOptimizer(m, torch.optim.AdamW, lr=1e-4)
    for _ in range(2):
        opt.zero_grad(); F.cross_entropy(m(ids).flatten(0,1).float(), ids.flatten()).backward(); opt.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
