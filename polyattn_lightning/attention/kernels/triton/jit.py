"""The ``@triton.jit`` code of the fused kernels: the forward and the two backward programs, and their helpers.

``FORM`` is a :class:`~polyattn_lightning.attention.forms.FusedForm` value, compared with the ``tl.constexpr``
constants below (the fourth form, ``SIGMOID``, is each ``if``'s last branch). Launched by ``op.py`` through the
tables of ``launch.py``; the module docstring of this package says what the programs compute and why.
"""

import triton
import triton.language as tl

from ...forms import FusedForm

POLY: tl.constexpr = tl.constexpr(int(FusedForm.POLY))
RELU: tl.constexpr = tl.constexpr(int(FusedForm.RELU))
SOFTPLUS: tl.constexpr = tl.constexpr(int(FusedForm.SOFTPLUS))


@triton.jit
def _phi(z, FORM: tl.constexpr, POWER: tl.constexpr):
    if FORM == POLY:
        f = z
        for _ in tl.static_range(POWER - 1):
            f = f * z
    elif FORM == RELU:
        f = tl.maximum(z, 0.0)
    elif FORM == SOFTPLUS:  # stable for large |z|
        f = tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))
    else:
        f = 1.0 / (1.0 + tl.exp(-z))
    return f


@triton.jit
def _dphi(z, FORM: tl.constexpr, POWER: tl.constexpr):
    if FORM == POLY:
        g = z * 0.0 + POWER
        for _ in tl.static_range(POWER - 1):
            g = g * z
    elif FORM == RELU:
        g = tl.where(z > 0, 1.0, 0.0)
    elif FORM == SOFTPLUS:
        g = 1.0 / (1.0 + tl.exp(-z))
    else:
        s = 1.0 / (1.0 + tl.exp(-z))
        g = s * (1.0 - s)
    return g


@triton.jit
def _mm(a, b, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` with both operands cast to ``OPERAND``, accumulated in fp32."""
    return tl.dot(a.to(OPERAND), b.to(OPERAND), input_precision=PRECISION)


@triton.jit
def _keep(seed, threshold, bh, offs_m, start, BLOCK_N: tl.constexpr):
    """Dropout's keep decisions for keys ``start + [0, BLOCK_N)``: word ``j % 4`` of
    ``philox(seed, j // 4, i, bh, 0)`` >= threshold, one Philox call per four keys."""
    groups = start // 4 + tl.arange(0, BLOCK_N // 4)
    rows = offs_m[:, None] + groups[None, :] * 0
    zero = rows * 0
    r0, r1, r2, r3 = tl.philox(seed, groups[None, :] + zero, rows, zero + bh, zero)
    # join(join(r0, r2), join(r1, r3))[i, g, b, a] is word 2 b + a: row-major, it is key 4 g + 2 b + a
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (offs_m.shape[0], BLOCK_N))
    return words >= threshold.to(tl.uint32)


@triton.jit
def _scores(
    q,
    k,
    t,
    shift,
    bh,
    offs_m,
    start,
    offs_n,
    Nq,
    Nk,
    mask_base,
    sm_q,
    sm_k,
    bias_base,
    sb_q,
    sb_k,
    seed,
    threshold,
    OFFSET,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``z = S + b(n) + bias`` for a (queries x keys) block and whether each pair counts (mask, causal, dropout)."""
    z = _mm(q, tl.trans(k), QK, QK_PRECISION) * t + shift[:, None]
    valid = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
    if HAS_BIAS:
        bias = tl.load(bias_base + offs_m[:, None] * sb_q + offs_n[None, :] * sb_k, mask=valid, other=0.0)
        z += bias.to(tl.float32)
    if HAS_MASK:
        allowed = tl.load(mask_base + offs_m[:, None] * sm_q + offs_n[None, :] * sm_k, mask=valid, other=0)
        valid = valid & (allowed != 0)
    if DROPOUT:
        valid = valid & _keep(seed, threshold, bh, offs_m, start, BLOCK_N)
    return z, valid


@triton.jit
def _program(Nrows, BLOCK: tl.constexpr, HEADS_FASTEST: tl.constexpr):
    """``(flattened head, block)`` of this program on the 1-D grid of ``B*H x cdiv(Nrows, BLOCK)``."""
    pid, blocks = tl.program_id(0), tl.cdiv(Nrows, BLOCK)
    if HEADS_FASTEST:
        heads = tl.num_programs(0) // blocks
        return pid % heads, pid // heads
    else:
        return pid // blocks, pid % blocks


@triton.jit
def _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT: tl.constexpr):
    """This head's mask and bias base pointers (broadcast strides may be 0) and the dropout seed."""
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    if DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    return Mask + b * sm_b + h * sm_h, Bias + b * sb_b + h * sb_h, seed


@triton.jit
def _load_rows(ptr, offs, n, offs_d, d):
    """Rows ``offs`` (< n) of a contiguous ``(N, d)`` matrix, zero-padded to the block."""
    inside = (offs[:, None] < n) & (offs_d[None, :] < d)
    return tl.load(ptr + offs[:, None] * d + offs_d[None, :], mask=inside, other=0.0)


@triton.jit
def _store_rows(ptr, x, offs, n, offs_d, d):
    inside = (offs[:, None] < n) & (offs_d[None, :] < d)
    tl.store(ptr + offs[:, None] * d + offs_d[None, :], x.to(ptr.dtype.element_ty), mask=inside)


@triton.jit
def _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D):
    """A block of queries with their row scale ``c`` and row shift ``b``."""
    rows_ok = offs_m < Nq
    q = _load_rows(Q + bh.to(tl.int64) * Nq * D, offs_m, Nq, offs_d, D)
    c = tl.load(C + bh * Nq + offs_m, mask=rows_ok, other=0.0)
    return q, c, tl.load(Shift + bh * Nq + offs_m, mask=rows_ok, other=0.0)


@triton.jit
def _score_grad(
    z, valid, do_c, v, FORM: tl.constexpr, POWER: tl.constexpr, PV: tl.constexpr, PV_PRECISION: tl.constexpr
):
    """``dS = phi'(z) * (c dO V^T)``, zero on pairs that do not count."""
    return tl.where(valid, _dphi(z, FORM, POWER), 0.0) * _mm(do_c, tl.trans(v), PV, PV_PRECISION)


@triton.jit
def _forward(
    Q,
    K,
    V,
    Out,
    C,
    Shift,
    Mask,
    Bias,
    Seed,
    t,
    threshold,
    Nq,
    Nk,
    H,
    D,
    DV,
    sm_b,
    sm_h,
    sm_q,
    sm_k,
    sb_b,
    sb_h,
    sb_q,
    sb_k,
    OFFSET,
    FORM: tl.constexpr,
    POWER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK: tl.constexpr,
    PV: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Per query block: ``out = sum_k c phi(z) V``."""
    bh, pid = _program(Nq, BLOCK_M, HEADS_FASTEST)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
    mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
    K_head, V_head = K + bh.to(tl.int64) * Nk * D, V + bh.to(tl.int64) * Nk * DV
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    hi = Nk
    if CAUSAL:  # no key beyond the last row's reach
        hi = tl.minimum(Nk, (pid + 1) * BLOCK_M + OFFSET)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K_head, offs_n, Nk, offs_d, D)
        v = _load_rows(V_head, offs_n, Nk, offs_dv, DV)
        z, valid = _scores(
            q,
            k,
            t,
            shift,
            bh,
            offs_m,
            start,
            offs_n,
            Nq,
            Nk,
            mask_base,
            sm_q,
            sm_k,
            bias_base,
            sb_q,
            sb_k,
            seed,
            threshold,
            OFFSET,
            HAS_MASK,
            HAS_BIAS,
            DROPOUT,
            CAUSAL,
            QK,
            QK_PRECISION,
            BLOCK_N,
        )
        p = tl.where(valid, _phi(z, FORM, POWER), 0.0) * c[:, None]
        acc += _mm(p, v, PV, PV_PRECISION)
    _store_rows(Out + bh.to(tl.int64) * Nq * DV, acc, offs_m, Nq, offs_dv, DV)


@triton.jit
def _backward_kv(
    Q,
    K,
    V,
    DO,
    DK,
    DV_,
    C,
    Shift,
    Mask,
    Bias,
    Seed,
    t,
    threshold,
    Nq,
    Nk,
    H,
    D,
    DV,
    sm_b,
    sm_h,
    sm_q,
    sm_k,
    sb_b,
    sb_h,
    sb_q,
    sb_k,
    OFFSET,
    FORM: tl.constexpr,
    POWER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK: tl.constexpr,
    PV: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Per key block: ``dV = sum_q phi(z)^T (c dO)``, ``dK = t sum_q dS^T Q``."""
    bh, pid = _program(Nk, BLOCK_N, HEADS_FASTEST)
    start = pid * BLOCK_N
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = _load_rows(K + bh.to(tl.int64) * Nk * D, offs_n, Nk, offs_d, D)
    v = _load_rows(V + bh.to(tl.int64) * Nk * DV, offs_n, Nk, offs_dv, DV)
    mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
    DO_head = DO + bh.to(tl.int64) * Nq * DV
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    lo = 0
    if CAUSAL:  # no query before the first key's first reader
        lo = tl.maximum(0, start - OFFSET) // BLOCK_M * BLOCK_M
    for row in range(lo, Nq, BLOCK_M):
        offs_m = row + tl.arange(0, BLOCK_M)
        q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
        do_c = _load_rows(DO_head, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
        z, valid = _scores(
            q,
            k,
            t,
            shift,
            bh,
            offs_m,
            start,
            offs_n,
            Nq,
            Nk,
            mask_base,
            sm_q,
            sm_k,
            bias_base,
            sb_q,
            sb_k,
            seed,
            threshold,
            OFFSET,
            HAS_MASK,
            HAS_BIAS,
            DROPOUT,
            CAUSAL,
            QK,
            QK_PRECISION,
            BLOCK_N,
        )
        p = tl.where(valid, _phi(z, FORM, POWER), 0.0)
        dv += _mm(tl.trans(p), do_c, PV, PV_PRECISION)
        ds = _score_grad(z, valid, do_c, v, FORM, POWER, PV, PV_PRECISION)
        dk += _mm(tl.trans(ds), q, PV, PV_PRECISION)
    _store_rows(DK + bh.to(tl.int64) * Nk * D, dk * t, offs_n, Nk, offs_d, D)
    _store_rows(DV_ + bh.to(tl.int64) * Nk * DV, dv, offs_n, Nk, offs_dv, DV)


@triton.jit
def _backward_q(
    Q,
    K,
    V,
    DO,
    DQ,
    DBias,
    C,
    Shift,
    Mask,
    Bias,
    Seed,
    t,
    threshold,
    Nq,
    Nk,
    H,
    D,
    DV,
    sm_b,
    sm_h,
    sm_q,
    sm_k,
    sb_b,
    sb_h,
    sb_q,
    sb_k,
    OFFSET,
    FORM: tl.constexpr,
    POWER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    CAUSAL: tl.constexpr,
    QK: tl.constexpr,
    PV: tl.constexpr,
    QK_PRECISION: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
):
    """Per query block: ``dQ = t sum_k dS K``; with ``BIAS_GRAD`` also writes ``dS`` (the bias gradient)."""
    bh, pid = _program(Nq, BLOCK_M, HEADS_FASTEST)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
    do_c = _load_rows(DO + bh.to(tl.int64) * Nq * DV, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
    mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
    K_head, V_head = K + bh.to(tl.int64) * Nk * D, V + bh.to(tl.int64) * Nk * DV
    DS_head = DBias + bh.to(tl.int64) * Nq * Nk
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(Nk, (pid + 1) * BLOCK_M + OFFSET)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_rows(K_head, offs_n, Nk, offs_d, D)
        v = _load_rows(V_head, offs_n, Nk, offs_dv, DV)
        z, valid = _scores(
            q,
            k,
            t,
            shift,
            bh,
            offs_m,
            start,
            offs_n,
            Nq,
            Nk,
            mask_base,
            sm_q,
            sm_k,
            bias_base,
            sb_q,
            sb_k,
            seed,
            threshold,
            OFFSET,
            HAS_MASK,
            HAS_BIAS,
            DROPOUT,
            CAUSAL,
            QK,
            QK_PRECISION,
            BLOCK_N,
        )
        ds = _score_grad(z, valid, do_c, v, FORM, POWER, PV, PV_PRECISION)
        if BIAS_GRAD:
            inside = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
            tl.store(DS_head + offs_m[:, None] * Nk + offs_n[None, :], ds, mask=inside)
        dq += _mm(ds, k, PV, PV_PRECISION)
    _store_rows(DQ + bh.to(tl.int64) * Nq * D, dq * t, offs_m, Nq, offs_d, D)
