import time, torch, dmuon_ns as d
from dmuon_ns.testing import reference_newton_schulz as ref, relative_error as re
print(torch.__version__, torch.cuda.get_device_name())
print(d.get_backend_status()); print(d.get_ns_backend())
def tm(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize(); ts=[]
    for _ in range(n):
        s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return sorted(ts)[n//2]
for shape in [(1024,4096),(4096,1024),(2048,8192),(4096,4096),(32,1024,4096)]:
    g=torch.randn(shape,device='cuda',dtype=torch.bfloat16)
    r=ref(g[:2] if len(shape)==3 else g)
    for kern in ['torch','auto']:
        for cg in [False, True]:
            ns=d.NewtonSchulz(kernel=kern, cuda_graphs=cg)
            try:
                y=ns(g); err=re(y[:2] if len(shape)==3 else y, r)
                ms=tm(lambda: ns(g))
                print(f"{str(shape):18} {kern:6} graphs={cg!s:5} {ms:8.3f} ms err {err:.2e} fin {bool(torch.isfinite(y).all())}")
            except Exception as ex:
                print(shape, kern, cg, 'FAILED', type(ex).__name__, str(ex)[:300])
ys=d.newton_schulz([torch.randn(512,2048,device='cuda') for _ in range(4)]+[torch.randn(2048,512,device='cuda')])
print([tuple(y.shape) for y in ys])
print(d.get_backend_status())
