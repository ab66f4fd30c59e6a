"""Weight-only INT8 linear for 1..16 tokens on the tensor cores, with the weights stored as
ready-made MMA fragments: ``y = x @ (q * scale[:, None]).T + bias``.

Why a separate kernel. The ``"mma"`` kind of ``int8_linear.py`` lets Triton stage int8 tiles
in shared memory, convert them and feed ``tl.dot``; on the H200 it streams about 1.5 TB/s of
int8 at M = 2..16, so it is only 1.1-1.3x faster than cuBLAS bf16.
Here every thread's 16-byte load *is* its share of the MMA operand, as in Marlin (Frantar et
al., "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models",
2024), whose idea this follows (not its code): no shared memory, no layout conversion; the
weights go global -> registers -> two bf16 MMAs a 16-byte load (four with two token tiles).

The MMA is PTX ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` issued by
``tl.inline_asm_elementwise``, with the weights as the A operand (16 output channels) and the
activations as B (8 tokens a tile; 1 or 2 tiles). PTX ISA, "Matrix Fragments for
mma.m16n8k16 with floating point type": lane ``l`` (group ``g = l // 4``, ``q = l % 4``)
holds A rows ``g`` and ``g + 8`` at K pairs ``2q, 2q+1`` and ``2q+8, 2q+9``, B column ``g``
at the same K pairs, and D rows ``g``, ``g + 8`` x columns ``2q, 2q + 1``. Since only the
*pairing* of A's and B's K indices matters, each 32-column K block is permuted so that lane
``l`` owns physical columns ``8q .. 8q + 7`` of both its A rows and its B column: K step
``s`` (0, 1) of the block maps fragment pairs ``(2q, 2q+1)`` -> ``8q + 4s + (0, 1)`` and
``(2q+8, 2q+9)`` -> ``8q + 4s + (2, 3)``. One 16-byte load then holds a lane's A operand of
two K steps and one 16-byte load of x (8 bf16) its B operand of both.

Fragment layout (:func:`pack_int8_fragments`): int32 ``[N/16, K/32, 32, 4]``; chunk
``(nb, kb)`` lane ``l`` holds ``q[16 nb + g, 32 kb + 8q : +8]`` then
``q[16 nb + g + 8, 32 kb + 8q : +8]`` (16 bytes), each byte stored as ``q + 128``
(offset binary), which the conversion needs: a byte placed in the low mantissa of
``2^23`` reads as the fp32 ``2^23 + q + 128``; subtracting ``2^23 + 128`` leaves ``q``
exactly, whose fp32 low half is zero, so its high half is the bf16 (PRMT + FADD, no ``I2F``).

With ``FragConfig.tma`` (sm_90) the weights instead reach shared memory by TMA bulk-tensor
copies in Triton's software pipeline and are read from there in the same register layout; x
goes through that pipeline too, or, with ``prefetch`` as well, is loaded into registers one
step ahead by plain loads (which L1 caches for the other programs of the SM).

Work split (:class:`FragConfig`): a program owns ``blocks`` x 16 output channels and
``1 / split_k`` of K; its ``num_warps`` warps take interleaved K chunks, ``unroll`` chunks a
loop step each; the next step's chunks are loaded into registers before this step's MMAs
(``prefetch``) or copied into shared memory ``stages - 1`` steps ahead by Triton's software
pipeline (``cp.async``). Partial sums are reduced over the unrolled copies, then over the
warps (shared memory, Triton's ``tl.sum``), then over the K splits by the last split to
finish (a per-program arrival counter, as in ``int8_linear.py``'s fused split-K reduction).

Measured on the H200: 1.2-1.4x faster than bf16 cuBLAS at M = 2..8 on the Qwen2.5-1.5B
projections (the ``mma`` kind of ``int8_linear``: 0.86-1.44x), 1.8-1.9x on the 7B gate/up and
down; at M = 9..16 (two MMA tiles) 1.0-1.5x; launched with PDL back to back with the PDL-call
table (``_TUNED_PDL``), 1.5-1.75x on the 1.5B projections at M = 1..8 (docs/performance.md).
``int8_linear`` does not route here; the fused forward does, opt in
(``FastPathConfig.int8_fragments``, :mod:`llmserve.models.fused_forward`, with PDL for hidden
sizes <= 2048 by default): faster decode steps of 2-8 sequences for 0.5B and 1.5B shapes.

GPU only (``sm_80`` or later): the Triton interpreter cannot run inline PTX.
:func:`emulate_fragment_linear` is the same computation lane by lane in PyTorch, from the
PTX fragment tables; the CPU tests check the layout with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
try:  # host-side TMA descriptors (Triton >= 3.4); FragConfig.tma is unavailable without them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton
    TensorDescriptor = None

from .int8_layout import pack_int8_fragments, unpack_int8_fragments  # the layout (pure torch), re-exported
from ._launch import num_sms, pdl_available, pdl_launch_kwargs, pdl_start, pdl_wait, zeroed_counters
from .gemv import _gpu_name

__all__ = ["FragConfig", "choose_frag_config", "emulate_fragment_linear", "int8_frag_linear",
           "pack_int8_fragments", "unpack_int8_fragments"]

FRAG_MAX_M = 16  #: tokens a call serves (two 8-token MMA tiles)


def a_register_source(step: int, reg: int) -> tuple[int, int]:
    """``(word, byte pair)`` of a lane's 16-byte chunk that the kernel converts into A register
    ``reg`` (0-3) of K step ``step`` (0, 1): registers 0 / 2 hold row ``g`` (PTX K pairs
    ``2q, 2q+1`` / ``2q+8, 2q+9``) and come from word ``step``; registers 1 / 3 hold row
    ``g + 8`` and come from word ``2 + step``; pair 0 is bytes 0-1 of the word, pair 1 bytes
    2-3. The one table both :func:`_asm` (the PTX) and :func:`emulate_fragment_linear` read."""
    return (step + 2 * (reg % 2), reg // 2)


def emulate_fragment_linear(x: torch.Tensor, frags: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What :func:`int8_frag_linear` computes, lane by lane, in fp64 PyTorch (for tests).

    Built from the PTX ``m16n8k16`` fragment tables and the kernel's K permutation, not from
    :func:`pack_int8_fragments`: for every chunk and lane it decodes the A registers as the
    kernel's conversion does (:func:`a_register_source`), pairs each with the x value the
    lane holding that B element loads (x words ``2s``, ``2s + 1`` of K step ``s``), and places
    each product where the MMA would.

    Args:
        x: ``[M, K]`` float; frags: the fragment layout; scale: ``[N]``.

    Returns:
        ``[M, N]`` float64.
    """
    nbk, kbk = frags.shape[:2]
    m = x.shape[0]
    by = frags.contiguous().view(torch.uint8).reshape(nbk, kbk, 32, 16).long() - 128  # q per byte
    xd = x.double().reshape(m, kbk, 32)
    y = torch.zeros(m, nbk * 16, dtype=torch.float64)
    lane = torch.arange(32)
    g, q = lane // 4, lane % 4
    for s in range(2):  # K step within the 32-column block
        for reg in range(4):
            word, pair = a_register_source(s, reg)
            radd = 8 * (reg % 2)                             # PTX table: registers 1, 3 are row g + 8
            for e in range(2):  # element of the bf16x2 register
                kk = 2 * q + 8 * (reg // 2) + e           # fragment K index (PTX table)
                phys = 8 * q + 4 * s + 2 * (kk >= 8).long() + e  # the kernel's permutation
                a = by[:, :, lane, 4 * word + 2 * pair + e].double()  # [nb, kb, 32]
                row = g + radd
                # D[row, n] += A[row, kk] * B[kk, n]; B[kk, n] = x[n, phys] (lanes (n, q) hold it)
                xk = xd.gather(2, phys[None, None, :].expand(m, kbk, 32))  # [M, kb, 32 lanes]
                contrib = torch.einsum("bkl,mkl->mbl", a, xk)            # [M, nb, 32]
                idx = (torch.arange(nbk)[:, None] * 16 + row[None, :]).reshape(-1)
                y.index_add_(1, idx, contrib.reshape(m, -1))
    return y * scale.double()[None, :]


_CVT = """prmt.b32 t0, {w}, mg, {s0};
prmt.b32 t1, {w}, mg, {s1};
sub.f32 t0, t0, 0f4B000080;
sub.f32 t1, t1, 0f4B000080;
prmt.b32 {a}, t0, t1, 0x7632;
"""
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d}}}, {{{a}}}, {{{b}}}, {{{c}}};\n")


def _asm(tiles: int) -> tuple[str, str]:
    """PTX and constraints of one lane's step over a 16-byte chunk (pack = 4 elements):
    outputs the new accumulators (4 fp32 a tile), inputs the 4 weight words, 4 x words a tile,
    the 4 accumulators a tile."""
    n_out = 4 * tiles
    w = [f"${n_out + i}" for i in range(4)]
    xw = [[f"${n_out + 4 + 4 * t + i}" for i in range(4)] for t in range(tiles)]
    cin = [[f"${n_out + 4 + 4 * tiles + 4 * t + i}" for i in range(4)] for t in range(tiles)]
    body = ".reg .b32 t0, t1, mg, a<8>;\n.reg .f32 d<8>;\nmov.b32 mg, 0x4B000000;\n"
    # a0..a3: K step 0; a4..a7: step 1; register r of step s from a_register_source(s, r)
    for s in range(2):
        for r in range(4):
            word, pair = a_register_source(s, r)
            body += _CVT.format(w=w[word], s0=hex(0x7650 + 2 * pair), s1=hex(0x7650 + 2 * pair + 1),
                                a=f"a{4 * s + r}")
    for t in range(tiles):
        d = ", ".join(f"d{4 * t + i}" for i in range(4))
        body += _MMA.format(d=d, a="a0, a1, a2, a3", b=f"{xw[t][0]}, {xw[t][1]}", c=", ".join(cin[t]))
        body += _MMA.format(d=d, a="a4, a5, a6, a7", b=f"{xw[t][2]}, {xw[t][3]}", c=d)
    for t in range(tiles):
        for i in range(4):
            body += f"mov.f32 ${4 * t + i}, d{4 * t + i};\n"
    cons = ",".join(["=f"] * n_out + ["r"] * (4 + 4 * tiles) + ["f"] * n_out)
    return "{\n" + body + "}", cons


_ASM1, _CONS1 = _asm(1)
_ASM2, _CONS2 = _asm(2)


@triton.jit(do_not_specialize=["M"])
def _int8_frag_kernel(x_ptr, w_ptr, w_desc, s_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, KB, kb_per_split,
                      stride_xm, stride_ym, HAS_BIAS: tl.constexpr, TILES: tl.constexpr, NB: tl.constexpr,
                      UNROLL: tl.constexpr, WARPS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
                      PREFETCH: tl.constexpr, ASM1: tl.constexpr, CONS1: tl.constexpr,
                      ASM2: tl.constexpr, CONS2: tl.constexpr, READ_ONLY: tl.constexpr = False,
                      STAGES: tl.constexpr = 1, L2_PREFETCH: tl.constexpr = False,
                      USE_PDL: tl.constexpr = False, PDL_TRIGGER_FIRST: tl.constexpr = False,
                      FOLD: tl.constexpr = False, TMA: tl.constexpr = False):
    """One program: ``NB`` blocks of 16 output channels x K chunks ``[kb_lo, kb_lo + kb_per_split)``.

    ``x_ptr`` is x as int32 words (two bf16 each, ``stride_xm`` in words); ``w_ptr`` the
    fragment layout; ``KB`` = K / 32. Element ``e`` of the last axis (``WARPS * 128``) is word
    ``e % 4`` of thread ``e // 4`` (the 16-byte vectorized layout Triton gives these loads),
    which is what the inline PTX takes four at a time. The ``NB`` weight chunks of one K chunk
    share the lane's x words (loaded once). ``PREFETCH``: the next loop step's loads are
    issued before this step's MMAs. ``READ_ONLY`` (a diagnostic, wrong results): the same
    loads with one FADD a word instead of the conversion and the MMAs. ``L2_PREFETCH``: the
    program's whole weight range is requested into L2 first (:func:`_l2_prefetch`).
    ``USE_PDL``: the L2 prefetch, the scales and (with ``PREFETCH``, not ``TMA``) the first
    step's weight chunks are requested before the PDL wait (``_launch.pdl_wait``), x after it.
    ``FOLD``: the ``UNROLL`` chunks' MMAs start from zero and are summed into one ``[NB, T*4]`` accumulator a
    tile each step (``UNROLL`` times fewer loop-carried registers, ``4 NB UNROLL`` FADDs a tile
    a step); otherwise each unrolled chunk keeps its own accumulator until the end. ``TMA``
    (``NB == 1``): a step's ``STEP`` weight chunks are one contiguous box of
    ``w_desc`` (the fragments as ``[N/16 * KB, 128]`` words), copied into shared memory by the
    Tensor Memory Accelerator in Triton's software pipeline (``STAGES - 1`` steps ahead, no
    registers or L1 miss slots held while in flight); rows past ``kb_hi`` meet zero x words.
    ``TMA`` with ``PREFETCH``: x by plain loads one step ahead in registers, not in the
    pipeline (whose ``cp.async`` copies bypass L1).
    """
    pdl_start(USE_PDL, PDL_TRIGGER_FIRST)
    T: tl.constexpr = WARPS * 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.arange(0, T * 4)
    warp = e // 128
    lane = (e // 4) % 32
    tok = lane // 4                               # B column (token) of the lane, tile 0
    xcol = (lane % 4) * 4 + e % 4                 # word of x within a 32-column chunk
    u = tl.arange(0, UNROLL)
    b = tl.arange(0, NB)
    # output of D register j of lane l (after the reductions, f = 4 l + j): channel
    # 16 nb + l // 4 + 8 (j // 2), token (l % 4) * 2 + j % 2
    f = tl.arange(0, 128)
    ch = (pid_n * NB + b[:, None]) * 16 + (f // 16)[None, :] + 8 * ((f % 4) // 2)[None, :]   # [NB, 128]
    tk = (((f // 4) % 4) * 2 + f % 2)[None, :]
    sc = tl.load(s_ptr + ch).to(tl.float32)       # before the loop: off the critical path
    if HAS_BIAS:
        bias = tl.load(bias_ptr + ch).to(tl.float32)
    else:
        bias = sc
    kb_lo = pid_k * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, KB)
    if L2_PREFETCH:
        _l2_prefetch(w_ptr, pid_n, KB, kb_lo, kb_hi, NB, T)
    chunk = kb_lo + u[:, None] * WARPS + warp[None, :]                       # [U, T*4] at step 0
    w_ptrs = (w_ptr + ((pid_n * NB + b[:, None, None]).to(tl.int64) * KB + kb_lo) * 128
              + u[None, :, None] * (T * 4) + e[None, None, :])                # [NB, U, T*4]
    x0_ptrs = x_ptr + tok[None, :] * stride_xm + chunk * 16 + xcol[None, :]
    x1_ptrs = x0_ptrs + 8 * stride_xm
    tok_ok0 = (tok < M)[None, :]
    tok_ok1 = (tok + 8 < M)[None, :]
    STEP: tl.constexpr = UNROLL * WARPS
    if FOLD:
        acc0 = tl.zeros([NB, T * 4], dtype=tl.float32)
        acc1 = tl.zeros([NB, T * 4], dtype=tl.float32)
    else:
        acc0 = tl.zeros([NB, UNROLL, T * 4], dtype=tl.float32)
        acc1 = tl.zeros([NB, UNROLL, T * 4], dtype=tl.float32)
    if TMA:
        # the step's STEP chunks are one contiguous [STEP, 128]-word box of the [N/16 * KB, 128]
        # view: row u * WARPS + warp is chunk u of warp `warp`, i.e. w[0, u, e] (see w_ptrs)
        row = pid_n * KB + kb_lo
        pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
        if PREFETCH:  # x by plain loads one step ahead in registers (L1), outside the pipeline
            x0, x1 = _frag_x_loads(x0_ptrs, x1_ptrs, chunk < kb_hi, tok_ok0, tok_ok1, TILES, EVEN)
            for k0 in tl.range(kb_lo, kb_hi, STEP, num_stages=STAGES):
                w = tl.reshape(w_desc.load([row + (k0 - kb_lo), 0]), [1, UNROLL, T * 4])
                x0_ptrs += STEP * 16
                x1_ptrs += STEP * 16
                nxt = (chunk + (k0 + STEP - kb_lo)) < kb_hi
                x0n, x1n = _frag_x_loads(x0_ptrs, x1_ptrs, nxt, tok_ok0, tok_ok1, TILES, False)
                acc0, acc1 = _frag_mma(w, x0, x1, acc0, acc1, TILES, ASM1, CONS1, ASM2, CONS2, READ_ONLY, FOLD)
                x0, x1 = x0n, x1n
        else:
            for k0 in tl.range(kb_lo, kb_hi, STEP, num_stages=STAGES):
                ok = (chunk + (k0 - kb_lo)) < kb_hi
                w = tl.reshape(w_desc.load([row + (k0 - kb_lo), 0]), [1, UNROLL, T * 4])
                x0, x1 = _frag_x_loads(x0_ptrs, x1_ptrs, ok, tok_ok0, tok_ok1, TILES, EVEN)
                acc0, acc1 = _frag_mma(w, x0, x1, acc0, acc1, TILES, ASM1, CONS1, ASM2, CONS2, READ_ONLY, FOLD)
                x0_ptrs += STEP * 16
                x1_ptrs += STEP * 16
    elif PREFETCH:
        w = _frag_w_loads(w_ptrs, chunk < kb_hi, EVEN)
        pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)  # x (and y, the workspace) after the wait
        x0, x1 = _frag_x_loads(x0_ptrs, x1_ptrs, chunk < kb_hi, tok_ok0, tok_ok1, TILES, EVEN)
        for k0 in range(kb_lo, kb_hi, STEP):
            w_ptrs += STEP * 128
            x0_ptrs += STEP * 16
            x1_ptrs += STEP * 16
            nxt = (chunk + (k0 + STEP - kb_lo)) < kb_hi
            wn, x0n, x1n = _frag_loads(w_ptrs, x0_ptrs, x1_ptrs, nxt, tok_ok0, tok_ok1, TILES, False)
            acc0, acc1 = _frag_mma(w, x0, x1, acc0, acc1, TILES, ASM1, CONS1, ASM2, CONS2, READ_ONLY, FOLD)
            w, x0, x1 = wn, x0n, x1n
    else:
        pdl_wait(USE_PDL, PDL_TRIGGER_FIRST)
        for k0 in tl.range(kb_lo, kb_hi, STEP, num_stages=STAGES):
            ok = (chunk + (k0 - kb_lo)) < kb_hi
            w, x0, x1 = _frag_loads(w_ptrs, x0_ptrs, x1_ptrs, ok, tok_ok0, tok_ok1, TILES, EVEN)
            acc0, acc1 = _frag_mma(w, x0, x1, acc0, acc1, TILES, ASM1, CONS1, ASM2, CONS2, READ_ONLY, FOLD)
            w_ptrs += STEP * 128
            x0_ptrs += STEP * 16
            x1_ptrs += STEP * 16
    _frag_store(acc0, ch, tk, sc, bias, pid_n, pid_k, M, N, y_ptr, ws_ptr, cnt_ptr, stride_ym,
                HAS_BIAS, SPLIT, NB, WARPS, TILES, 0, FOLD)
    if TILES == 2:
        _frag_store(acc1, ch, tk + 8, sc, bias, pid_n, pid_k, M, N, y_ptr, ws_ptr, cnt_ptr, stride_ym,
                    HAS_BIAS, SPLIT, NB, WARPS, TILES, 1, FOLD)


@triton.jit
def _frag_mma(w, x0, x1, acc0, acc1, TILES: tl.constexpr, ASM1: tl.constexpr, CONS1: tl.constexpr,
              ASM2: tl.constexpr, CONS2: tl.constexpr, READ_ONLY: tl.constexpr, FOLD: tl.constexpr = False):
    """``acc_t += `` the lane's MMAs over its weight chunks ``w [NB, U, T*4]`` and x words
    ``x_t [U, T*4]`` (broadcast over the NB channel blocks: the same registers). ``acc_t`` is
    ``[NB, U, T*4]`` (one accumulator an unrolled chunk, the MMAs chain through it) or, with
    ``FOLD``, ``[NB, T*4]`` (the MMAs start from zero and the U results are summed into it)."""
    if FOLD:
        c0 = tl.zeros(w.shape, dtype=tl.float32)
        c1 = c0
    else:
        c0 = acc0
        c1 = acc1
    if READ_ONLY:
        d0 = c0 + (w ^ x0[None]).to(tl.float32, bitcast=True)
        d1 = c1
        if TILES == 2:
            d1 = c1 + x1[None].to(tl.float32, bitcast=True)
    elif TILES == 2:
        d0, d1 = tl.inline_asm_elementwise(ASM2, CONS2, [w, x0[None], x1[None], c0, c1],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        d0 = tl.inline_asm_elementwise(ASM1, CONS1, [w, x0[None], c0], dtype=tl.float32, is_pure=True, pack=4)
        d1 = c1
    if FOLD:
        acc0 += tl.sum(d0, axis=1)
        if TILES == 2:
            acc1 += tl.sum(d1, axis=1)
    else:
        acc0 = d0
        acc1 = d1
    return acc0, acc1


@triton.jit
def _frag_w_loads(w_ptrs, ok, EVEN: tl.constexpr):
    """One loop step's weight chunks ``[NB, U, T*4]``; chunks with ``ok`` false read as zeros
    (int8 0 is the byte 0x80 in offset binary)."""
    if EVEN:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=ok[None], other=-0x7F7F7F80, eviction_policy="evict_first")
    return w


@triton.jit
def _frag_x_loads(x0_ptrs, x1_ptrs, ok, tok_ok0, tok_ok1, TILES: tl.constexpr, EVEN: tl.constexpr):
    """One loop step's x words ``[U, T*4]`` of tile 0 and, with ``TILES == 2``, tile 1
    (zeros outside the K range or past the last token)."""
    if EVEN:
        x0 = tl.load(x0_ptrs, mask=tok_ok0, other=0)
        x1 = x0
        if TILES == 2:
            x1 = tl.load(x1_ptrs, mask=tok_ok1, other=0)
    else:
        x0 = tl.load(x0_ptrs, mask=ok & tok_ok0, other=0)
        x1 = x0
        if TILES == 2:
            x1 = tl.load(x1_ptrs, mask=ok & tok_ok1, other=0)
    return x0, x1


@triton.jit
def _frag_loads(w_ptrs, x0_ptrs, x1_ptrs, ok, tok_ok0, tok_ok1, TILES: tl.constexpr, EVEN: tl.constexpr):
    """One loop step's weight chunks and x words (:func:`_frag_w_loads`, :func:`_frag_x_loads`)."""
    w = _frag_w_loads(w_ptrs, ok, EVEN)
    x0, x1 = _frag_x_loads(x0_ptrs, x1_ptrs, ok, tok_ok0, tok_ok1, TILES, EVEN)
    return w, x0, x1


# One thread's bulk prefetch into L2 (PTX ISA, ``cp.async.bulk.prefetch.L2``; sm_90+): $1 the
# address, $2 the bytes (a multiple of 16; nothing when 0). The output is a dummy.
_L2PF_ASM = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.b32 $0, 0;
}""")


@triton.jit
def _l2_prefetch(w_ptr, pid_n, KB, kb_lo, kb_hi, NB: tl.constexpr, T: tl.constexpr):
    """Request the program's weight chunks ``[kb_lo, kb_hi)`` of its ``NB`` channel blocks
    into L2 with bulk prefetches (each of the ``T`` threads a contiguous run of whole 512-byte
    chunks), so every byte the program reads is in flight at once without registers; the
    loop's loads then mostly hit L2."""
    t = tl.arange(0, T)
    nk = kb_hi - kb_lo
    per = (nk + T - 1) // T
    start = t * per
    count = tl.minimum(tl.maximum(nk - start, 0), per)
    for b in tl.static_range(NB):
        addr = w_ptr + ((pid_n * NB + b).to(tl.int64) * KB + kb_lo + start) * 128
        tl.inline_asm_elementwise(_L2PF_ASM, "=r,l,r", [addr.to(tl.int64, bitcast=True), count * 512],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _frag_store(acc, ch, tk, sc, bias, pid_n, pid_k, M, N, y_ptr, ws_ptr, cnt_ptr, stride_ym,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, NB: tl.constexpr, WARPS: tl.constexpr,
                TILES: tl.constexpr, TILE: tl.constexpr, FOLD: tl.constexpr = False):
    """Reduce one tile's ``[NB, UNROLL, WARPS * 128]`` (``FOLD``: ``[NB, WARPS * 128]``) partial sums to ``[NB, 128]`` (channel
    ``ch``, token ``tk``) and store ``y`` (scaled, + bias); with ``SPLIT`` > 1 K splits the
    last split of the program's channels to arrive sums the partials in split order
    (deterministic), all ``SPLIT`` loads issued at once (one L2 round trip)."""
    if FOLD:
        part = tl.sum(tl.reshape(acc, [NB, WARPS, 128]), axis=1)
    else:
        part = tl.sum(tl.reshape(tl.sum(acc, axis=1), [NB, WARPS, 128]), axis=1)
    mask = (tk < M) & (ch < N)
    if SPLIT > 1:
        tl.store(ws_ptr + (pid_k * M + tk).to(tl.int64) * N + ch, part, mask=mask)
        if TILE == TILES - 1:
            tl.debug_barrier()
            count = tl.atomic_add(cnt_ptr + pid_n, 1)
            if count == SPLIT - 1:
                for t in tl.static_range(TILES):
                    tkr = tk - 8 * (TILES - 1) + 8 * t
                    mk = (tkr < M) & (ch < N)
                    tot = tl.zeros([NB, 128], dtype=tl.float32)
                    for s in tl.static_range(SPLIT):
                        tot += tl.load(ws_ptr + (s * M + tkr).to(tl.int64) * N + ch, mask=mk, other=0.0,
                                       cache_modifier=".cg")
                    yv = tot * sc
                    if HAS_BIAS:
                        yv += bias
                    tl.store(y_ptr + tkr.to(tl.int64) * stride_ym + ch, yv.to(y_ptr.dtype.element_ty), mask=mk)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        yv = part * sc
        if HAS_BIAS:
            yv += bias
        tl.store(y_ptr + tk.to(tl.int64) * stride_ym + ch, yv.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class FragConfig:
    """Launch configuration of :func:`int8_frag_linear`: ``num_warps`` warps a program,
    ``unroll`` 16-byte chunks a warp loads per loop step and 16-channel block, ``split_k``
    programs along K, ``blocks`` 16-channel blocks a program (sharing the x loads),
    ``prefetch``: issue the next step's loads before this step's MMAs (registers; with ``tma``,
    x's only); ``stages`` > 1 (without ``prefetch`` or ``tma``): Triton's software pipeline
    copies weights and x into shared memory ``stages - 1`` steps ahead (``cp.async``), then
    each step reads them from there (with ``tma``: see below).
    ``l2_prefetch``: each program first requests its whole weight range into L2 with bulk
    prefetches (``cp.async.bulk.prefetch.L2``, sm_90 or later). ``fold``: one accumulator a
    16-channel block and token tile, the ``unroll`` chunks' MMA results summed into it every
    step, instead of one accumulator an unrolled chunk (fewer registers: more programs fit on
    an SM, and ``blocks`` > 1 with two token tiles fits at all). ``tma`` (sm_90 or later,
    Triton >= 3.4; needs ``blocks == 1`` and no ``l2_prefetch``): each step's weight chunks,
    one contiguous ``[unroll * num_warps, 128]``-word box, are copied into shared memory by the
    Tensor Memory Accelerator inside Triton's software pipeline, ``stages - 1`` steps ahead.
    Without ``prefetch`` the pipeline copies x too (``cp.async``, which bypasses L1: every
    program's x comes from L2); with ``prefetch`` x is loaded into registers one step ahead by
    plain loads, outside the pipeline, so the programs of an SM share it through L1. The box
    needs ``stages * unroll * num_warps * 512`` bytes of shared memory (more fails at compile
    time).

    Raises:
        ValueError: a field out of range or a ``tma`` configuration with blocks or L2
        prefetch."""

    num_warps: int = 4
    unroll: int = 4
    split_k: int = 1
    blocks: int = 1
    prefetch: bool = False
    stages: int = 1
    l2_prefetch: bool = False
    fold: bool = False
    tma: bool = False

    def __post_init__(self) -> None:
        for name in ("num_warps", "unroll", "blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1) or v > 64:
                raise ValueError(f"FragConfig.{name} must be a power of two in 1..64, got {v!r}")
        for name in ("split_k", "stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"FragConfig.{name} must be an int >= 1, got {v!r}")
        if self.tma and (self.blocks != 1 or self.l2_prefetch):
            raise ValueError("FragConfig.tma needs blocks=1 and l2_prefetch=False")


# H200 sweep winners (Qwen2.5-0.5B / 1.5B / 7B shapes), keyed by (N, K, MMA tiles: 1 for M <= 8, 2 for M = 9..16); the configuration with the
# lowest summed time over the swept M of that tile count (M = 2, 4, 8 / 2, 8; M = 16).
_TUNED_GPU = "NVIDIA H200"
_TUNED: dict[tuple[int, int, int], FragConfig] = {
    (8960, 1536, 1): FragConfig(4, 4, 1, prefetch=True), (8960, 1536, 2): FragConfig(2, 8, 1),
    (1536, 8960, 1): FragConfig(4, 4, 6, prefetch=True), (1536, 8960, 2): FragConfig(2, 8, 6),
    (2048, 1536, 1): FragConfig(4, 2, 1, stages=5), (2048, 1536, 2): FragConfig(2, 8, 1, stages=5),
    (18944, 3584, 1): FragConfig(2, 4, 1, prefetch=True), (18944, 3584, 2): FragConfig(4, 2, 1, 2, True),
    (3584, 18944, 1): FragConfig(4, 4, 1, 2, stages=5), (3584, 18944, 2): FragConfig(4, 4, 1, 2, stages=4),
    (4608, 3584, 1): FragConfig(2, 4, 1, stages=4), (4608, 3584, 2): FragConfig(4, 4, 1, prefetch=True),
    (4864, 896, 1): FragConfig(2, 8, 1, prefetch=True), (4864, 896, 2): FragConfig(2, 8, 1),
    (896, 4864, 1): FragConfig(4, 2, 1, stages=5), (896, 4864, 2): FragConfig(4, 2, 1, stages=5),
    (1152, 896, 1): FragConfig(4, 8, 1, prefetch=True), (1152, 896, 2): FragConfig(2, 2, 1, stages=5),
}


# H200 winners for calls launched with PDL back to back (the engine's fragment decode steps for
# hidden sizes <= 2048), from a PDL sweep with and without ``fold`` on the 1.5B shapes, checked
# in alternated rounds of whole steps. Only 1.5B gate/up at <= 8 tokens changed: ``fold`` lets
# 8 chunks a warp a step fit in 132 registers, 4-13% faster than the plain table's
# configuration with PDL. The sweep's other winners add the L2 prefetch, which made engine
# steps slower although it wins in chains of one kernel. Down (K = 8960) takes TMA weight
# copies without split-K (4-11% faster than the split-K register-prefetch configuration at
# M = 2..16); at 9..16 tokens it loads x a step ahead in registers (``prefetch`` with ``tma``).
_TUNED_PDL: dict[tuple[int, int, int], FragConfig] = {
    (8960, 1536, 1): FragConfig(2, 8, 1, prefetch=True, fold=True),
    (1536, 8960, 1): FragConfig(4, 8, 1, stages=3, tma=True),
    (1536, 8960, 2): FragConfig(4, 8, 1, prefetch=True, stages=3, tma=True),
}


def choose_frag_config(m: int, n: int, k: int, device: torch.device | None = None,
                       gpu_name: str | None = None, pdl: bool = False) -> FragConfig:
    """Default launch configuration: the H200 sweep's winner for the Qwen2.5 0.5B / 1.5B / 7B
    projection shapes (``_TUNED``; with ``pdl``, i.e. for a call launched with PDL, the 1.5B
    shapes from ``_TUNED_PDL``), else a rule written from the 1.5B winners:

    * split K when K is long (>= 128 chunks) and there are fewer than two 16-channel blocks
      per SM, to about 4.4 programs per SM (down, K = 8960, N = 1536: 6 splits);
    * few blocks and no split (qkv, N = 2048): Triton's ``cp.async`` pipeline, 5 stages,
      2 chunks a warp a step; otherwise loads into registers one step ahead (``prefetch``),
      4 chunks a warp a step;
    * more than 8 tokens (two MMA tiles, twice the x registers): 2 warps of 8 chunks, no
      register prefetch.

    ``gpu_name`` (default: the device's) selects the table; other GPUs get the rule. A
    ``tma`` entry of ``_TUNED_PDL`` is skipped where this Triton has no TMA descriptors.
    """
    if gpu_name is None and device is not None and device.type == "cuda":
        gpu_name = _gpu_name(device)                   # cached per device
    tiles = 1 if m <= 8 else 2
    if pdl and gpu_name == _TUNED_GPU:
        cfg = _TUNED_PDL.get((n, k, tiles))
        if cfg is not None and (TensorDescriptor is not None or not cfg.tma):
            return cfg
    if gpu_name == _TUNED_GPU and (n, k, tiles) in _TUNED:
        return _TUNED[(n, k, tiles)]
    sms = num_sms(device, cpu_default=132) if device is not None else 132
    nb, kb = n // 16, k // 32
    split = 1
    if kb >= 128 and nb < 2 * sms:
        split = max(1, min(8, round(4.4 * sms / nb)))
    stages = 5 if split == 1 and nb <= 2 * sms else 1
    if tiles == 2:
        return FragConfig(2, 8, split, stages=stages)
    if stages > 1:
        return FragConfig(4, 2, split, stages=stages)
    return FragConfig(4, 4, split, prefetch=True)


def int8_frag_linear(x: torch.Tensor, frags: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, config: FragConfig | None = None,
                     pdl: bool = False, pdl_trigger_first: bool = False,
                     _read_only: bool = False) -> torch.Tensor:
    """``y = x @ (q * scale[:, None]).T + bias`` for ``M <= 16`` tokens, ``q`` given in the
    fragment layout (:func:`pack_int8_fragments`).

    Args:
        x: ``[..., K]`` bf16 on a CUDA device, at most 16 rows in all (copied first unless its
            rows are contiguous, 16-byte aligned and a multiple of 16 bytes apart: every lane's
            x load is one 16-byte vector).
        frags: int32 ``[N/16, K/32, 32, 4]``, contiguous, 16-byte aligned (as allocated), on
            x's device.
        scale: ``[N]`` per-output-channel scales, a floating-point tensor.
        bias: optional ``[N]`` floating-point tensor.
        config: launch configuration (default :func:`choose_frag_config`, told whether the call
            launches with PDL).
        pdl: launch with programmatic dependent launch where the device and Triton allow it
            (``_launch.pdl_available``; ignored elsewhere): ``frags``, ``scale`` and ``bias``
            are read before the kernel waits for the previous one (the L2 prefetch, with
            ``config.prefetch`` and not ``config.tma`` the first step's chunks), so no earlier
            kernel of the same PDL chain may write them (strided ``scale``/``bias`` are copied first, and the call
            then launches without PDL); x is read, and y written, after the wait.
        pdl_trigger_first: with ``pdl``, let the next kernel launch before this one waits
            (``_launch.pdl_wait``).
        _read_only: diagnostic for benchmarks (wrong results): the kernel's
            loads without the conversion and MMAs.

    Returns:
        ``[..., N]`` in ``x.dtype`` (fp32 accumulation, one rounding at the end).

    Raises:
        ValueError: wrong dtypes, shapes, devices, alignment, ``config.blocks`` not dividing
        ``N / 16``, ``config.l2_prefetch`` or ``config.tma`` before sm_90, ``config.tma`` before
        Triton 3.4, or more than 16 rows;
        NotImplementedError on a CPU tensor (inline PTX; use :func:`emulate_fragment_linear`).
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(frags, torch.Tensor) or frags.dtype != torch.int32 or frags.dim() != 4 \
            or tuple(frags.shape[2:]) != (32, 4) or not frags.is_contiguous():
        raise ValueError("frags must be a contiguous int32 tensor [N/16, K/32, 32, 4] (pack_int8_fragments)")
    n, k = frags.shape[0] * 16, frags.shape[1] * 32
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} but the weight has K={k}")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != (n,):
            raise ValueError(f"{name} must be a floating-point tensor [N] = [{n}], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if x.device.type != "cuda":
        raise NotImplementedError("int8_frag_linear runs inline PTX: CUDA only (emulate_fragment_linear on CPU)")
    if not (frags.device == x.device == scale.device and (bias is None or bias.device == x.device)):
        raise ValueError("x, frags, scale and bias must be on one device")
    if frags.data_ptr() % 16:
        # each lane's 16-byte load must be one vector: Triton vectorizes only 16-byte aligned
        # pointers, and the inline PTX takes each thread's four words as its MMA operand
        raise ValueError("frags must be 16-byte aligned (a fresh tensor or a whole-chunk slice)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > FRAG_MAX_M or m == 0:
        raise ValueError(f"int8_frag_linear serves 1..{FRAG_MAX_M} rows, got {m}")
    copied = not scale.is_contiguous() or (bias is not None and not bias.is_contiguous())
    # scale and bias are read before the PDL wait: not when a copy kernel just wrote them
    pdl = bool(pdl) and not copied and pdl_available(x.device)
    cfg = config or choose_frag_config(m, n, k, x.device, pdl=pdl)  # FragConfig validates its fields
    if (n // 16) % cfg.blocks:
        raise ValueError(f"config.blocks={cfg.blocks} must divide N / 16 = {n // 16}")
    for flag in ("l2_prefetch", "tma"):
        if getattr(cfg, flag) and torch.cuda.get_device_capability(x.device)[0] < 9:
            raise ValueError(f"config.{flag} needs sm_90 or later (cp.async.bulk)")
    if cfg.tma and TensorDescriptor is None:
        raise ValueError("config.tma needs Triton >= 3.4 (triton.tools.tensor_descriptor)")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = torch.empty((m, k), dtype=x.dtype, device=x.device).copy_(x2)  # rows 16-byte aligned
    scale = scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    kb = k // 32
    split = max(1, min(cfg.split_k, kb))
    kb_per = triton.cdiv(kb, split)
    split = triton.cdiv(kb, kb_per)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    cnt = zeroed_counters("int8_frag", x.device, n // 16) if split > 1 else y
    even = kb % kb_per == 0 and kb_per % (cfg.unroll * cfg.num_warps) == 0
    desc = None
    if cfg.tma:  # one loop step's chunks of one split: a [unroll * num_warps, 128]-word box
        desc = TensorDescriptor(frags.view(-1, 128), [n // 16 * kb, 128], [128, 1],
                                [cfg.unroll * cfg.num_warps, 128])
    _int8_frag_kernel[(n // 16 // cfg.blocks, split)](
        x2.view(torch.int32), frags, desc, scale, bias if bias is not None else scale, y, ws, cnt,
        m, n, kb, kb_per, x2.stride(0) // 2, y.stride(0),
        HAS_BIAS=bias is not None, TILES=1 if m <= 8 else 2, NB=cfg.blocks, UNROLL=cfg.unroll,
        WARPS=cfg.num_warps, SPLIT=split, EVEN=even, PREFETCH=cfg.prefetch, READ_ONLY=_read_only,
        STAGES=cfg.stages, L2_PREFETCH=cfg.l2_prefetch, FOLD=cfg.fold, TMA=cfg.tma, ASM1=_ASM1, CONS1=_CONS1, ASM2=_ASM2,
        CONS2=_CONS2, num_warps=cfg.num_warps, num_stages=1, **pdl_launch_kwargs(pdl, pdl_trigger_first))
    return y.reshape(*lead, n)
