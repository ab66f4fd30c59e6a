"""Triton row-wise argmax (``triton_kernels/argmax.py``) against ``torch.argmax`` (interpreter on
CPU; the GPU in the decode graph)."""
import pytest
import torch

from llmserve.kernels.argmax import argmax_rows

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
