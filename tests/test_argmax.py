"""Triton row-wise argmax (``triton_kernels/argmax.py``) against ``torch.argmax`` (interpreter on
CPU; the GPU in the decode graph)."""
import pytest
import torch

from llmserve.triton_kernels.argmax import argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("b,v,block,progs", [(1, 1, 16, 4), (1, 17, 16, 4), (3, 100, 16, 4),
                                              (2, 1000, 16, 3), (1, 151936 // 16, 64, 7), (4, 513, 32, 64)])
def test_argmax_matches_torch(b, v, block, progs):
    g = torch.Generator().manual_seed(b * 1000 + v)
    x = torch.randn(b, v, generator=g).to(DEVICE)
    got = argmax_rows(x, block=block, max_programs=progs)
    assert got.dtype == torch.int64 and got.shape == (b,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_argmax_ties_nan_inf_first_index():
    """Ties keep the first index, across chunks too; NaN beats every number (its first
    occurrence); an all -inf row gives 0; +inf is an ordinary maximum."""
    v = 200
    x = torch.zeros(6, v)
    x[0, [5, 50, 150]] = 3.0                     # tie across chunks (block 16, several programs)
    x[1, [120, 7]] = float("inf")
    x[2, 3] = 9.0
    x[2, [90, 170]] = float("nan")
    x[3] = float("-inf")
    x[4, 199] = 1.0                               # the last element
    x[5] = -1.0                                   # all equal
    x = x.to(DEVICE)
    for progs in (1, 3, 64):
        got = argmax_rows(x, block=16, max_programs=progs)
        assert got.tolist() == x.argmax(dim=-1).tolist() == [5, 7, 90, 0, 199, 0]


def test_argmax_out_and_errors():
    x = torch.randn(2, 40).to(DEVICE)
    out = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(x, out, block=16, max_programs=2) is out
    assert torch.equal(out, x.argmax(-1))
    argmax_rows(x, out, block=16, max_programs=2)  # counters re-armed: a second call is right too
    assert torch.equal(out, x.argmax(-1))
    for bad in (torch.randn(4).to(DEVICE), torch.randn(2, 0).to(DEVICE), torch.randn(40, 2).to(DEVICE).t(),
                torch.ones(2, 3, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(ValueError, match="2-D float"):
            argmax_rows(bad)
    with pytest.raises(ValueError, match="out must be a contiguous int64"):
        argmax_rows(x, torch.empty(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be a contiguous int64"):
        argmax_rows(x, torch.empty(4, dtype=torch.int64, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(x, block=24)
    assert argmax_rows(torch.randn(0, 5).to(DEVICE)).shape == (0,)


@pytest.mark.parametrize("progs", [1, 3])
def test_argmax_selected_output_row(progs):
    """``out_row``: the result goes to row ``out_row[0]`` of a ``[R, B]`` output chosen on the
    device (the decode graphs alternate two rows); the other rows are untouched; a wrong
    ``out`` or ``out_row`` is an error."""
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    buf = torch.full((2, 8), -5, dtype=torch.int64, device=DEVICE)
    for row in (1, 0):
        sel = torch.tensor([row], device=DEVICE)
        before = buf.clone()
        assert argmax_rows(x, buf[:, :3], out_row=sel, block=16, max_programs=progs) is not None
        assert torch.equal(buf[row, :3], x.argmax(dim=-1))
        assert torch.equal(buf[1 - row], before[1 - row]) and torch.equal(buf[row, 3:], before[row, 3:])
    sel = torch.tensor([0], device=DEVICE)
    for bad_out in (buf[0, :3], buf[:, :2], buf[:, :3].float(), buf.t()[:3]):
        with pytest.raises(ValueError, match="with out_row"):
            argmax_rows(x, bad_out, out_row=sel)
    for bad_sel in (torch.tensor([[0]], device=DEVICE), torch.tensor([0], dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="out_row must be"):
            argmax_rows(x, buf[:, :3], out_row=bad_sel)


# ---- the argmax merged into a producer (gemv's argmax_keys) + argmax_finalize ----------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llmserve.triton_kernels.argmax import (ARGMAX_EMPTY, argmax_finalize, argmax_key,  # noqa: E402
                                            argmax_key_buffer)
from llmserve.triton_kernels.gemv import GemvConfig, gemv  # noqa: E402


@triton.jit
def _keys_kernel(v_ptr, k_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(k_ptr + offs, argmax_key(tl.load(v_ptr + offs), offs))


def test_argmax_keys_order_like_torch():
    """The packed keys order (value, index) pairs as ``torch.argmax`` does: a larger value wins,
    NaN above +inf, -0 equal to +0, a tie goes to the smaller index; checked on every pair of a
    list of special and random values (the integer maximum of each pair's keys names the pair
    member torch.argmax picks)."""
    special = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
               1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, 0.0]
    vals = torch.tensor(special + torch.randn(18, generator=torch.Generator().manual_seed(1)).tolist())
    n = vals.numel()                                        # 32, a power of two
    keys = torch.empty(n, dtype=torch.int64)
    vd, kd = vals.to(DEVICE), keys.to(DEVICE)
    _keys_kernel[(1,)](vd, kd, N=n)
    keys = kd.cpu()
    assert bool((keys > ARGMAX_EMPTY).all())
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            lo, hi = min(i, j), max(i, j)
            want = (lo, hi)[int(torch.stack([vals[lo], vals[hi]]).argmax())]
            got = lo if keys[lo] > keys[hi] else hi
            assert got == want, (i, j, vals[i].item(), vals[j].item())


@pytest.mark.parametrize("m,n,cfg", [(1, 1, GemvConfig(4, 16, 1, 1)), (1, 37, GemvConfig(4, 16, 1, 1)),
                                     (3, 100, GemvConfig(8, 16, 1, 1)), (4, 70, GemvConfig(2, 32, 1, 1, 1)),
                                     (2, 53, GemvConfig(1, 16, 1, 1, 0, 4))])
def test_gemv_argmax_keys_match_torch(m, n, cfg):
    """``gemv(..., argmax_keys=)`` + ``argmax_finalize``: torch.argmax of the returned logits
    (fp32 with an exact tie, and bf16), single and persistent grids, ``red``, in a selected
    output row; the key buffer is left empty for the next launch, which is checked by
    running twice with different inputs."""
    g = torch.Generator().manual_seed(m * 100 + n)
    keys = argmax_key_buffer(torch.device(DEVICE), m, owner="test")[:m]
    assert bool((keys == ARGMAX_EMPTY).all())
    for rep in range(2):
        x = torch.randn(m, 40, generator=g).to(DEVICE)
        w = torch.randn(n, 40, generator=g).to(DEVICE)
        w[n // 2] = w[0]                                         # an exact tie in every row
        logits = torch.empty(m, n, device=DEVICE)
        gemv(x, w, out=logits, argmax_keys=keys, config=cfg)
        out = torch.full((2, m), -5, dtype=torch.int64, device=DEVICE)
        argmax_finalize(keys, out, out_row=torch.tensor([rep % 2], device=DEVICE))
        assert torch.equal(out[rep % 2], logits.argmax(-1)), rep
        assert bool((out[1 - rep % 2] == -5).all())
        assert bool((keys == ARGMAX_EMPTY).all())
    # bf16 logits (out in x's dtype): rounding makes ties common; the keys are of the stored
    # values, so the result is torch.argmax of what gemv returns (whatever the interpreter's
    # bf16 arithmetic gives)
    xb = torch.randn(m, 40, generator=g).to(DEVICE, torch.bfloat16)
    wb = (torch.randn(n, 40, generator=g) * 0.01).to(DEVICE, torch.bfloat16)
    yb = gemv(xb, wb, argmax_keys=keys, config=cfg)
    assert yb.dtype == torch.bfloat16
    got = argmax_finalize(keys, torch.empty(m, dtype=torch.int64, device=DEVICE))
    assert torch.equal(got, yb.argmax(-1))


def test_argmax_finalize_and_keys_errors():
    keys = argmax_key_buffer(torch.device(DEVICE), 2, owner="test")[:2]
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="argmax_keys must be a contiguous int64"):
        gemv(x, w, argmax_keys=keys[:1])
    with pytest.raises(ValueError, match="argmax_keys must be a contiguous int64"):
        gemv(x, w, argmax_keys=keys.int())
    with pytest.raises(ValueError, match="no glu"):
        gemv(x, torch.randn(12, 8, device=DEVICE), glu=True, argmax_keys=keys)
    with pytest.raises(ValueError, match="keys must be a contiguous int64"):
        argmax_finalize(keys.float(), torch.empty(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out must be a contiguous int64"):
        argmax_finalize(keys, torch.empty(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="with out_row"):
        argmax_finalize(keys, torch.empty(2, dtype=torch.int64, device=DEVICE),
                        out_row=torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out_row must be int64"):
        argmax_finalize(keys, torch.empty(2, 2, dtype=torch.int64, device=DEVICE),
                        out_row=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    assert bool((keys == ARGMAX_EMPTY).all())                # nothing launched
