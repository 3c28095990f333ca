import torch; torch.set_num_threads(1)
from dmuon_ns._coefficients import POLAR_EXPRESS_COEFFICIENTS as PE, coefficients_for_steps
from dmuon_ns.testing import reference_newton_schulz as ref, relative_error as re
C = coefficients_for_steps(PE, 5)
def prep(g):
    x = g.float()[None]; x = x / (x.norm(dim=(-2,-1), keepdim=True)+1e-7); return x.half()
def run(x, variant, restarts=(2,)):
    eye = torch.eye(x.shape[-2], dtype=x.dtype)
    r = torch.bmm(x, x.mT); q = None
    for i,(a,b,c) in enumerate(C):
        if i in restarts:
            x = torch.bmm(q, x); r = torch.bmm(x, x.mT); q = None
        if variant == 'fused':
            z = torch.baddbmm(r, r, r, beta=b, alpha=c)
            q = z + a*eye if q is None else torch.baddbmm(q, q, z, beta=a)
            if i < 4 and i+1 not in restarts:
                rz = torch.baddbmm(r, r, z, beta=a); r = torch.baddbmm(rz, z, rz, beta=a)
        elif variant == 'fused_left':
            z = torch.baddbmm(r, r, r, beta=b, alpha=c)
            q = z + a*eye if q is None else torch.baddbmm(q, z, q, beta=a)
            if i < 4 and i+1 not in restarts:
                rz = torch.baddbmm(r, r, z, beta=a); r = torch.baddbmm(rz, z, rz, beta=a)
        elif variant == 'full':
            z = torch.baddbmm(r, r, r, beta=b, alpha=c) + a*eye
            q = z if q is None else torch.bmm(z, q)
            if i < 4 and i+1 not in restarts:
                r = torch.bmm(torch.bmm(z, r), z)
        elif variant == 'full_right':
            z = torch.baddbmm(r, r, r, beta=b, alpha=c) + a*eye
            q = z if q is None else torch.bmm(q, z)
            if i < 4 and i+1 not in restarts:
                r = torch.bmm(torch.bmm(z, r), z)
        elif variant == 'fused_sym':
            z = torch.baddbmm(r, r, r, beta=b, alpha=c)
            q = z + a*eye if q is None else torch.baddbmm(q, q, z, beta=a)
            if i < 4 and i+1 not in restarts:
                rz = torch.baddbmm(r, r, z, beta=a); r = torch.baddbmm(rz, z, rz, beta=a)
                r = 0.5*(r + r.mT)
    return torch.bmm(q, x)
for dev in (['cuda'] if torch.cuda.is_available() else ['cpu']):
  for shape in [(256,1024),(1024,4096)]:
    g = torch.randn(shape, device=dev); rr = ref(g)
    print(dev, shape, ' '.join('%s %.2e' % (v, re(run(prep(g), v)[0], rr)) for v in ['fused','fused_left','full','full_right','fused_sym']))

def run2(x, qmode, rmode, restarts=(2,)):
    eye = torch.eye(x.shape[-2], dtype=x.dtype, device=x.device)
    r = torch.bmm(x, x.mT); q = None
    for i,(a,b,c) in enumerate(C):
        if i in restarts:
            x = torch.bmm(q, x); r = torch.bmm(x, x.mT); q = None
        zp = torch.baddbmm(r, r, r, beta=b, alpha=c); zf = zp + a*eye
        if q is None: q = zf
        else: q = torch.baddbmm(q, q, zp, beta=a) if qmode == 'fused' else torch.bmm(zf, q)
        if i < 4 and i+1 not in restarts:
            if rmode == 'fused':
                rz = torch.baddbmm(r, r, zp, beta=a); r = torch.baddbmm(rz, zp, rz, beta=a)
            elif rmode == 'full':
                r = torch.bmm(torch.bmm(zf, r), zf)
            else:  # full products, but fused a-term
                rz = torch.baddbmm(r, r, zp, beta=a); r = torch.bmm(zf, rz)
    return torch.bmm(q, x)
for dev in (['cuda'] if torch.cuda.is_available() else ['cpu']):
  for shape in [(256,1024),(1024,4096),(2048,8192)]:
    g = torch.randn(shape, device=dev); rr = ref(g)
    print(dev, shape, ' '.join('%s/%s %.2e' % (qm, rm, re(run2(prep(g), qm, rm)[0], rr)) for qm in ['fused','full'] for rm in ['fused','full','mixed']))
