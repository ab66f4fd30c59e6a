"""The INT8 MMA-fragment linear (``triton_kernels/int8_frag.py``).

CPU: the layout (pack/unpack round trip, the byte each lane reads) and a lane-by-lane
emulation built from the PTX ``m16n8k16`` fragment tables against ``x @ (q * s).T``, so a
wrong permutation fails here without a GPU. GPU (``gpu`` marker): the kernel itself in bf16
against an fp64 reference at awkward sizes (1, 7, 8, 9, 16 rows; one 16-channel block; K of
one chunk; K not a multiple of a loop step; split-K with a ragged last split; bias).
"""

from __future__ import annotations

import pytest
import torch

import re

from llmserve.kernels.int8_frag import (
    _ASM1,
    _ASM2,
    FRAG_MAX_M,
    FragConfig,
    a_register_source,
    choose_frag_config,
    emulate_fragment_linear,
    int8_frag_linear,
    pack_int8_fragments,
    unpack_int8_fragments,
)

gpu = pytest.mark.gpu


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (32, 320)])
def test_pack_round_trip_and_lane_bytes(n, k):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    f = pack_int8_fragments(q)
    assert f.shape == (n // 16, k // 32, 32, 4) and f.dtype == torch.int32
    assert torch.equal(unpack_int8_fragments(f), q)
    by = f.view(torch.uint8).reshape(n // 16, k // 32, 32, 16)
    # lane 13 of chunk (nb=last, kb=last): group 3, q 1 -> rows 3 and 11, columns 8..15
    nb, kb = n // 16 - 1, k // 32 - 1
    rows = q[16 * nb + 3], q[16 * nb + 11]
    want = torch.cat([rows[0][32 * kb + 8: 32 * kb + 16], rows[1][32 * kb + 8: 32 * kb + 16]])
    assert torch.equal((by[nb, kb, 13] ^ 0x80).view(torch.int8), want)


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 48, 96), (8, 32, 64), (16, 32, 160)])
def test_emulation_matches_reference(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) + 0.5
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    torch.testing.assert_close(emulate_fragment_linear(x, pack_int8_fragments(q), s), ref, rtol=1e-12, atol=1e-9)


def test_emulation_sees_a_wrong_layout():
    """The emulation is not the pack's inverse: row-major int8 reinterpreted as fragments fails."""
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    wrong = (q.view(torch.uint8) ^ 0x80).view(torch.int32).reshape(1, 2, 32, 4)
    ref = x.double() @ q.double().T
    assert (emulate_fragment_linear(x, wrong, torch.ones(16)) - ref).abs().max() > 1.0


def test_default_configs():
    """On the H200 the table's sweep winners; elsewhere the rule, which reproduces the 1.5B
    winners without the table."""
    h200 = "NVIDIA H200"
    assert choose_frag_config(2, 18944, 3584, gpu_name=h200) == FragConfig(2, 4, 1, prefetch=True)  # 7B
    assert choose_frag_config(12, 3584, 18944, gpu_name=h200) == FragConfig(4, 4, 1, 2, stages=4)
    for name in (h200, "other"):
        assert choose_frag_config(2, 8960, 1536, gpu_name=name) == FragConfig(4, 4, 1, prefetch=True)  # gate/up
        assert choose_frag_config(16, 8960, 1536, gpu_name=name) == FragConfig(2, 8, 1)
        assert choose_frag_config(4, 1536, 8960, gpu_name=name) == FragConfig(4, 4, 6, prefetch=True)  # down
        assert choose_frag_config(16, 1536, 8960, gpu_name=name) == FragConfig(2, 8, 6)
        assert choose_frag_config(8, 2048, 1536, gpu_name=name) == FragConfig(4, 2, 1, stages=5)  # qkv
        assert choose_frag_config(16, 2048, 1536, gpu_name=name) == FragConfig(2, 8, 1, stages=5)
    assert choose_frag_config(2, 18944, 3584, gpu_name="other") == FragConfig(4, 4, 1, prefetch=True)


def test_default_configs_for_pdl_calls(monkeypatch):
    """Calls launched with PDL get the PDL sweeps' winners where they differ (1.5B gate/up at
    <= 8 tokens, down with TMA, on the H200); other shapes and GPUs the plain table."""
    h200 = "NVIDIA H200"
    assert choose_frag_config(3, 8960, 1536, gpu_name=h200, pdl=True) == FragConfig(2, 8, 1, prefetch=True, fold=True)
    assert choose_frag_config(16, 8960, 1536, gpu_name=h200, pdl=True) == FragConfig(2, 8, 1)
    assert choose_frag_config(8, 1536, 8960, gpu_name=h200, pdl=True) == FragConfig(4, 8, 1, stages=3, tma=True)
    assert choose_frag_config(12, 1536, 8960, gpu_name=h200, pdl=True) == FragConfig(4, 8, 1, prefetch=True, stages=3,
                                                                                     tma=True)
    assert choose_frag_config(8, 1536, 8960, gpu_name=h200) == FragConfig(4, 4, 6, prefetch=True)
    assert choose_frag_config(3, 8960, 1536, gpu_name=h200, pdl=False) == FragConfig(4, 4, 1, prefetch=True)
    assert choose_frag_config(3, 8960, 1536, gpu_name="other", pdl=True) == FragConfig(4, 4, 1, prefetch=True)
    assert choose_frag_config(2, 18944, 3584, gpu_name=h200, pdl=True) == FragConfig(2, 4, 1, prefetch=True)  # 7B
    import llmserve.kernels.int8_frag as frag
    monkeypatch.setattr(frag, "TensorDescriptor", None)           # a Triton without TMA descriptors
    assert choose_frag_config(8, 1536, 8960, gpu_name=h200, pdl=True) == FragConfig(4, 4, 6, prefetch=True)
    monkeypatch.undo()


@pytest.mark.parametrize("asm,tiles", [(_ASM1, 1), (_ASM2, 2)])
def test_ptx_reads_the_register_table(asm, tiles):
    """The PTX converts each A register from the word and byte pair the emulation assumes,
    feeds x words 2s, 2s+1 as B of step s, and chains step 1 onto step 0's accumulators."""
    cvt = re.findall(r"prmt\.b32 t0, \$(\d+), mg, (0x[0-9a-f]+);\nprmt\.b32 t1, \$\1, mg, (0x[0-9a-f]+);"
                     r"\nsub\.f32 t0.*\nsub\.f32 t1.*\nprmt\.b32 a(\d), t0, t1, 0x7632;", asm)
    n_out = 4 * tiles
    assert len(cvt) == 8
    for operand, s0, s1, a in cvt:
        step, reg = divmod(int(a), 4)
        word, pair = a_register_source(step, reg)
        assert int(operand) == n_out + word
        assert (int(s0, 16), int(s1, 16)) == (0x7650 + 2 * pair, 0x7651 + 2 * pair)
    mma = re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32 \{(.*?)\}, \{(.*?)\}, "
                     r"\{(.*?)\}, \{(.*?)\};", asm)
    assert len(mma) == 2 * tiles
    for i, (d, a, b, c) in enumerate(mma):
        t, step = divmod(i, 2)
        assert a == ", ".join(f"a{4 * step + r}" for r in range(4))
        x0 = n_out + 4 + 4 * t
        assert b == f"${x0 + 2 * step}, ${x0 + 2 * step + 1}"
        assert d == ", ".join(f"d{4 * t + r}" for r in range(4))
        cin = n_out + 4 + 4 * tiles + 4 * t
        assert c == (", ".join(f"${cin + r}" for r in range(4)) if step == 0 else d)


def test_validation():
    with pytest.raises(ValueError, match="N % 16"):
        pack_int8_fragments(torch.zeros(24, 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="K % 32"):
        pack_int8_fragments(torch.zeros(16, 40, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        pack_int8_fragments(torch.zeros(16, 32))
    with pytest.raises(ValueError, match="int32"):
        unpack_int8_fragments(torch.zeros(1, 1, 32, 4))
    f = pack_int8_fragments(torch.zeros(16, 32, dtype=torch.int8))
    s = torch.ones(16)
    with pytest.raises(ValueError, match="bf16"):
        int8_frag_linear(torch.zeros(1, 32), f, s)
    with pytest.raises(ValueError, match="K=64"):
        int8_frag_linear(torch.zeros(1, 64, dtype=torch.bfloat16), f, s)
    with pytest.raises(ValueError, match=r"\[N\]"):
        int8_frag_linear(torch.zeros(1, 32, dtype=torch.bfloat16), f, torch.ones(8))
    with pytest.raises(ValueError, match="scale"):
        int8_frag_linear(torch.zeros(1, 32, dtype=torch.bfloat16), f, 1.0)
    with pytest.raises(ValueError, match="scale"):
        int8_frag_linear(torch.zeros(1, 32, dtype=torch.bfloat16), f, torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="bias"):
        int8_frag_linear(torch.zeros(1, 32, dtype=torch.bfloat16), f, s, torch.ones(8))
    with pytest.raises(NotImplementedError, match="CUDA"):
        int8_frag_linear(torch.zeros(1, 32, dtype=torch.bfloat16), f, s)
    for bad in (dict(unroll=3), dict(num_warps=0), dict(blocks=6), dict(split_k=0), dict(stages=0),
                dict(tma=True, blocks=2), dict(tma=True, l2_prefetch=True)):
        with pytest.raises(ValueError, match="FragConfig"):
            FragConfig(**bad)
    assert FragConfig(tma=True, prefetch=True).prefetch   # TMA weights with x a step ahead in registers


def _skip_unsupported(cfg: FragConfig) -> None:
    """Skip configurations this GPU / Triton cannot run (they raise ValueError by design)."""
    import llmserve.kernels.int8_frag as frag

    if (cfg.tma or cfg.l2_prefetch) and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA and the bulk L2 prefetch need sm_90")
    if cfg.tma and frag.TensorDescriptor is None:
        pytest.skip("TMA descriptors need Triton >= 3.4")


@gpu
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k,cfg", [
    (16, 32, FragConfig(1, 1, 1)),                        # one chunk, one program
    (48, 96, FragConfig(2, 2, 1)),                        # K (3 chunks) not a multiple of the step (4)
    (48, 96, FragConfig(2, 1, 1, prefetch=True)),
    (64, 1536, FragConfig(4, 4, 1, blocks=2, prefetch=True)),
    (32, 8960, FragConfig(4, 4, 8, blocks=2)),            # 280 chunks: ragged splits of 35, steps of 16
    (32, 8960, FragConfig(2, 2, 4, prefetch=True)),
    (32, 8960, FragConfig(2, 4, 3, stages=4)),            # cp.async pipeline, ragged splits
    (48, 96, FragConfig(2, 2, 1, stages=3)),
    (2048, 1536, FragConfig(8, 2, 3, blocks=4, prefetch=True)),
    (48, 96, FragConfig(2, 2, 1, prefetch=True, l2_prefetch=True)),     # L2 prefetch: 3 chunks, 64 threads
    (64, 1536, FragConfig(4, 4, 1, blocks=2, l2_prefetch=True)),
    (32, 8960, FragConfig(2, 4, 3, prefetch=True, l2_prefetch=True)),   # ragged splits of 94, 94, 92
    (32, 8960, FragConfig(4, 2, 6, stages=3, l2_prefetch=True)),
    (48, 96, FragConfig(2, 2, 1, fold=True)),                            # fold: one accumulator a tile
    (48, 96, FragConfig(2, 2, 1, prefetch=True, fold=True)),
    (64, 1536, FragConfig(4, 4, 1, blocks=4, prefetch=True, fold=True)),
    (32, 8960, FragConfig(2, 4, 3, stages=4, fold=True)),
    (32, 8960, FragConfig(4, 2, 6, blocks=2, prefetch=True, l2_prefetch=True, fold=True)),
    (48, 96, FragConfig(2, 2, 1, stages=2, tma=True)),                   # TMA box of 4 chunks, 3 in K
    (16, 32, FragConfig(1, 1, 1, tma=True)),                             # one chunk, no pipeline
    (64, 1536, FragConfig(4, 4, 1, stages=3, fold=True, tma=True)),      # whole boxes, 3-step pipeline
    (48, 1600, FragConfig(4, 4, 1, stages=4, fold=True, tma=True)),      # 50 chunks: the last box runs past the tensor
    (32, 8960, FragConfig(2, 4, 3, stages=4, tma=True)),                 # ragged splits: rows of the next split
    (2048, 1536, FragConfig(8, 2, 3, stages=2, fold=True, tma=True)),
    (48, 96, FragConfig(2, 2, 1, prefetch=True, stages=2, tma=True)),     # TMA weights, x a step ahead in registers
    (16, 32, FragConfig(1, 1, 1, prefetch=True, tma=True)),
    (48, 1600, FragConfig(4, 4, 1, prefetch=True, stages=4, tma=True)),  # last box past the tensor, masked x
    (32, 8960, FragConfig(2, 4, 3, prefetch=True, stages=3, fold=True, tma=True)),  # ragged splits
])
def test_kernel_matches_reference(m, n, k, cfg):
    _skip_unsupported(cfg)
    g = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, generator=g) * 1e-2 + 1e-3)
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ref = x.double() @ (q.double() * s.double()[:, None]).T + bias.double()
    f = pack_int8_fragments(q).cuda()
    y = int8_frag_linear(x.cuda(), f, s.cuda(), bias.cuda(), config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 4e-3, err
    y2 = int8_frag_linear(x.cuda(), f, s.cuda(), bias.cuda(), config=cfg)   # counters re-armed
    assert torch.equal(y, y2)


@gpu
@pytest.mark.parametrize("cfg", [FragConfig(4, 4, 1, prefetch=True), FragConfig(4, 4, 1, prefetch=True, l2_prefetch=True),
                                 FragConfig(2, 2, 3, stages=3, l2_prefetch=True), FragConfig(2, 8, 2),
                                 FragConfig(2, 4, 1, blocks=2, prefetch=True, fold=True),
                                 FragConfig(2, 4, 2, stages=3, tma=True),
                                 FragConfig(2, 4, 1, prefetch=True, stages=3, tma=True)])
@pytest.mark.parametrize("m", [3, 12])
def test_pdl_chain_reads_the_previous_output(m, cfg):
    """Eight PDL launches back to back in a CUDA graph, each reading the previous one's output
    (a square 1536 x 1536 weight): with PDL a launch starts while its predecessor runs, and
    must read x only after its wait. Against the same chain without PDL and an fp64 chain."""
    from llmserve.kernels._launch import pdl_available

    if not pdl_available(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this GPU / Triton")
    _skip_unsupported(cfg)
    g = torch.Generator().manual_seed(m)
    d = 1536
    qs = [torch.randint(-127, 128, (d, d), dtype=torch.int8, generator=g) for _ in range(2)]
    s = torch.full((d,), 1.0 / (127 * d ** 0.5) * 2)
    sc = s.cuda()
    fs = [pack_int8_fragments(q).cuda() for q in qs]
    x = torch.randn(m, d, generator=g).to(torch.bfloat16).cuda()

    def chain(pdl: bool) -> torch.Tensor:
        h = x
        for i in range(8):
            h = int8_frag_linear(h, fs[i % 2], sc, config=cfg, pdl=pdl)
        return h

    ref = chain(False)
    chain(True)                                        # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    h = x.double().cpu()
    for i in range(8):
        h = (h @ (qs[i % 2].double() * s.double()[:, None]).T).bfloat16().double()
    assert ((ref.double().cpu() - h).norm() / h.norm()).item() < 2e-2


@gpu
@pytest.mark.parametrize("m", [1, 5, 8, 12, 16])
@pytest.mark.parametrize("n,k", [(8960, 1536), (1536, 8960), (2048, 1536), (896, 4864), (3584, 18944),
                                 (4608, 3584), (1152, 896)])
def test_default_config_matches_reference(m, n, k):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) * 1e-2 + 1e-3
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    f = pack_int8_fragments(q).cuda()
    for pdl in (False, True):  # with PDL: the PDL table's configuration where the GPU has one
        y = int8_frag_linear(x.cuda(), f, s.cuda(), pdl=pdl)
        assert ((y.double().cpu() - ref).norm() / ref.norm()).item() < 4e-3, pdl


@gpu
def test_config_follows_the_effective_pdl(monkeypatch):
    """int8_frag_linear picks its default configuration for the PDL setting it really launches
    with: not PDL when the scale had to be copied (strided) or PDL is unavailable."""
    import llmserve.kernels.int8_frag as frag

    seen = []
    real = frag.choose_frag_config
    monkeypatch.setattr(frag, "choose_frag_config",
                        lambda m, n, k, device=None, gpu_name=None, pdl=False: seen.append(pdl) or real(m, n, k, device,
                                                                                                      gpu_name, pdl))
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    f = pack_int8_fragments(q).cuda()
    x = torch.randn(3, 64, device="cuda").to(torch.bfloat16)
    strided = torch.rand(64, device="cuda")[::2]
    int8_frag_linear(x, f, strided, pdl=True)
    int8_frag_linear(x, f, strided.contiguous(), pdl=True)
    assert seen == [False, frag.pdl_available(x.device)]


@gpu
def test_kernel_handles_strided_and_unaligned_inputs():
    """x views with an odd offset or row stride, and non-contiguous scale / bias, are copied
    (the kernel's 16-byte vector loads); an unaligned weight is refused."""
    g = torch.Generator().manual_seed(5)
    n, k, m = 64, 96, 3
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) + 0.5
    bias = torch.randn(n, generator=g)
    xs = torch.randn(m, k + 9, generator=g).to(torch.bfloat16).cuda()
    x = xs[:, 1:k + 1]                                   # odd element offset, row stride k + 9
    ref = x.double().cpu() @ (q.double() * s.double()[:, None]).T + bias.double()
    f = pack_int8_fragments(q).cuda()
    s2 = torch.stack([s, s], 1).cuda()[:, 0]              # stride 2
    b2 = torch.stack([bias, bias], 1).cuda()[:, 1]
    y = int8_frag_linear(x, f, s2, b2, config=FragConfig(2, 2, 2))
    assert ((y.double().cpu() - ref).norm() / ref.norm()).item() < 4e-3
    # with pdl the copied scale / bias would be read before the wait: launched without PDL
    y2 = int8_frag_linear(x, f, s2, b2, config=FragConfig(2, 2, 2, prefetch=True), pdl=True)
    assert ((y2.double().cpu() - ref).norm() / ref.norm()).item() < 4e-3
    flat = torch.empty(f.numel() + 1, dtype=torch.int32, device="cuda")
    f_off = flat[1:].view(f.shape)                          # 4 bytes off
    f_off.copy_(f)
    with pytest.raises(ValueError, match="aligned"):
        int8_frag_linear(x, f_off, s2)


@gpu
def test_kernel_rejects_bad_calls():
    f = pack_int8_fragments(torch.zeros(48, 32, dtype=torch.int8)).cuda()
    s = torch.ones(48, device="cuda")
    with pytest.raises(ValueError, match="rows"):
        int8_frag_linear(torch.zeros(FRAG_MAX_M + 1, 32, dtype=torch.bfloat16, device="cuda"), f, s)
    with pytest.raises(ValueError, match="blocks"):
        int8_frag_linear(torch.zeros(2, 32, dtype=torch.bfloat16, device="cuda"), f, s,
                         config=FragConfig(blocks=2))
    with pytest.raises(ValueError, match="device"):
        int8_frag_linear(torch.zeros(2, 32, dtype=torch.bfloat16, device="cuda"), f, torch.ones(48))
