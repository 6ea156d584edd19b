"""head_logsumexp's Triton pass against torch on one GPU: bf16/fp32, with scale, soft-cap and temperature; time."""
import time, torch
from rollout_guard.support import head_logsumexp, kept_log_mass, scaled_logits, TIES

def timed(f, n=10):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1000

g = torch.Generator(device="cuda").manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for scale, softcap, temp in ((1.0, None, 1.0), (0.37, None, 0.7), (1.0, 30.0, 1.3)):
        raw = (torch.randn(220, 151_936, device="cuda", generator=g) * 4 - 3).to(dtype)
        ids = torch.randint(0, 151_936, (220,), device="cuda", generator=g)
        a = head_logsumexp(raw, ids, scale, softcap, temp, kernel=True)
        b = head_logsumexp(raw, ids, scale, softcap, temp, kernel=False)
        d = [float((x - y).abs().max()) for x, y in zip(a, b)]
        tk = timed(lambda: head_logsumexp(raw, ids, scale, softcap, temp, kernel=True))
        tt = timed(lambda: head_logsumexp(raw, ids, scale, softcap, temp, kernel=False))
        top = lambda: kept_log_mass(scaled_logits(raw.topk(20 + TIES, dim=-1).values, scale, softcap, temp), top_k=20, total=b[0])
        full = lambda: kept_log_mass(scaled_logits(raw, scale, softcap, temp), top_k=20, total=b[0])
        dm = float((top() - full()).abs().max())
        print(f"{str(dtype):15s} scale {scale} softcap {softcap} T {temp}: max|Δ| total {d[0]:.2e} own {d[1]:.2e}; "
              f"220 rows: kernel {tk:.3f} ms, torch {tt:.3f} ms; topk of raw {timed(top):.3f} ms vs of scaled {timed(full):.3f} ms, max|Δ log Z| {dm:.2e}", flush=True)
