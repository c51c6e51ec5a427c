"""tandem's AdamW (kernels/cpu/cpu_adamw.c through ops_adamw_step) against torch.optim.AdamW itself.

The CPU kernel mirrors the order of operations of torch's single-tensor AdamW (the path torch takes for CPU
tensors), so over 10 steps the parameters agree to float rounding: every step's parameters within 1e-6
relative of torch's (max |ours - torch| / max |torch|), and the final moments likewise. A kernel that applied
the same formula in a different order (e.g. eps inside the square root, bias correction folded differently,
weight decay after the update) drifts far past that.
"""
import subprocess

import numpy as np
import pytest
import torch

from conftest import tool

N, STEPS = 4099, 10


def f32(x):
    """The float32 value the C tool will see for a hyperparameter, as a Python float (what torch is given)."""
    return float(np.float32(x))


CASES = {
    "default": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad_scale=1.0),
    "strong decay, clipped grads": dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, grad_scale=0.3),
    "no decay": dict(lr=5e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, grad_scale=1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adamw_matches_torch(case):
    exe = tool("adamw_tool")
    h = CASES[case]
    lr, b1, b2, eps, wd, gs = (f32(h["lr"]), f32(h["betas"][0]), f32(h["betas"][1]), f32(h["eps"]),
                               f32(h["weight_decay"]), f32(h["grad_scale"]))
    g = torch.Generator().manual_seed(7)
    p0 = torch.randn(N, generator=g, dtype=torch.float32)
    # Gradients of varying scale, a few exact zeros (v stays 0 there: denom = eps).
    grads = [torch.randn(N, generator=g) * (10.0 ** (s % 3 - 1)) for s in range(STEPS)]
    for gr in grads:
        gr[:5] = 0.0

    stdin = p0.numpy().tobytes() + b"".join(gr.numpy().tobytes() for gr in grads)
    args = [exe, str(N), str(STEPS)] + [repr(x) for x in (lr, b1, b2, eps, wd, gs)]
    proc = subprocess.run(args, input=stdin, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    out = np.frombuffer(proc.stdout, dtype=np.float32)
    assert out.size == STEPS * N + 2 * N, f"tool wrote {out.size} floats"
    ours = torch.from_numpy(out[: STEPS * N].copy()).view(STEPS, N)
    ours_m = torch.from_numpy(out[STEPS * N : STEPS * N + N].copy())
    ours_v = torch.from_numpy(out[STEPS * N + N :].copy())

    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    for s in range(STEPS):
        p.grad = grads[s] * gs  # the kernel scales the gradient in fp32 the same way
        opt.step()
        rel = ((ours[s] - p.detach()).abs().max() / p.detach().abs().max()).item()
        assert rel <= 1e-6, f"step {s + 1}: parameters differ from torch by {rel:.3g} (relative)"
    st = opt.state[p]
    for name, a, b in (("exp_avg", ours_m, st["exp_avg"]), ("exp_avg_sq", ours_v, st["exp_avg_sq"])):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel <= 1e-6, f"{name} differs from torch by {rel:.3g} (relative)"
