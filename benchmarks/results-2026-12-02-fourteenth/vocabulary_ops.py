import torch, time
def t(f, n=5):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter()-s)/n*1000
V=151936
for rows in (220, 1766, 16384):
    x = torch.randn(rows, V, device='cuda', dtype=torch.bfloat16)*3
    xf = x.float()
    print(rows, 'rows: float() %.2f ms' % t(lambda: x.float()),
          'topk20 fp32 %.2f' % t(lambda: xf.topk(20, dim=-1)), 'topk20 bf16 %.2f' % t(lambda: x.topk(20, dim=-1)),
          'logsumexp fp32 %.2f' % t(lambda: torch.logsumexp(xf, -1)), 'eq-sum %.2f' % t(lambda: (xf == xf[:, :1]).sum(-1)),
          'sort bf16 %.2f' % t(lambda: x.sort(dim=-1)), 'amax %.2f' % t(lambda: xf.amax(-1)), flush=True)
    del x, xf
