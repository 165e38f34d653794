"""The ``@triton.jit`` programs of the exact linear-time ``poly{p}`` form (``kernels/power/parallel.py``).

Three programs, each over the monomial features ``m(x)`` (``D = C(d+p-1, p)`` of them, the coordinates of
monomial ``f`` in ``INDEX[l, f]``, ``l < P``) built in registers from gathered loads of a token block (never
stored), in blocks of ``BLOCK_F`` features:

* :func:`_power_state`: ``STATE[h, c] = sum_{j in chunk c} w? m(x_j) y_j^T`` (``D x dv``, fp32), one program per
  (head, chunk, feature block); with ``GROUPED`` the tokens of the kv head's ``groups`` query heads;
* :func:`_power_apply`: ``OUT[j] (+)= SCALE_j w? m(x_j)^T STATE[h // groups, chunk(j)]``, one program per
  (head, row block), a row block inside one chunk;
* :func:`_power_grad`: ``DX[j] = SCALE_j J_m(x_j)^T (w? * (STATE[., chunk(j)] y_j))``: the gradient through the
  features; the scatter of each monomial's derivative onto its ``P`` coordinates is a product with a one-hot
  ``(BLOCK_F x BLOCK_D)`` matrix built from ``INDEX``, so it runs on tensor cores as well.

Products accumulate in fp32 on operands of ``DOT`` (bf16 for bf16 inputs; fp32 in TF32 or tf32x3 otherwise, the
quadratic kernels' policy, ``launch.product_types``). ``KEEP`` (1/0 per key) zeroes a padded token's loads, so an
inf there gives no NaN.
"""

import triton
import triton.language as tl


@triton.jit
def _features(xrow, rmask, INDEX, f, fmask, D, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """``m(x)`` of a block of rows: ``(BLOCK_R, BLOCK_F)`` fp32; ``xrow`` points at each row's first coordinate."""
    out = tl.full((BLOCK_R, BLOCK_F), 1.0, tl.float32)
    for level in tl.static_range(P):
        idx = tl.load(INDEX + level * D + f, mask=fmask, other=0)
        out = out * tl.load(xrow[:, None] + idx[None, :], mask=rmask[:, None] & fmask[None, :], other=0.0).to(
            tl.float32
        )
    return out


@triton.jit
def _power_state(
    X,
    Y,
    KEEP,
    INDEX,
    WEIGHT,
    STATE,
    rows,
    d,
    dv,
    D,
    chunk,
    n_chunks,
    n_fblocks,
    groups,
    P: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    GROUPED: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    fblock = pid % n_fblocks
    c = (pid // n_fblocks) % n_chunks
    h = pid // (n_fblocks * n_chunks)
    f = fblock * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = f < D
    e = tl.arange(0, BLOCK_DV)
    emask = e < dv
    start = c * chunk
    stop = tl.minimum(start + chunk, rows)
    acc = tl.zeros((BLOCK_F, BLOCK_DV), tl.float32)
    members = groups if GROUPED else 1
    for member in range(members):
        head = h * groups + member if GROUPED else h
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < stop
            if HAS_KEEP:
                valid = valid & (tl.load(KEEP + h * rows + n, mask=n < stop, other=0.0) != 0)
            feats = _features(X + (head * rows + n) * d, valid, INDEX, f, fmask, D, P, BLOCK_N, BLOCK_F)
            if WEIGHTED:
                feats = feats * tl.load(WEIGHT + f, mask=fmask, other=0.0)[None, :]
            y = tl.load(
                Y + (head * rows + n)[:, None] * dv + e[None, :], mask=valid[:, None] & emask[None, :], other=0.0
            )
            acc = tl.dot(tl.trans(feats).to(DOT), y.to(DOT), acc, input_precision=PRECISION)
    out = STATE + ((h * n_chunks + c) * D + f[:, None]) * dv + e[None, :]
    tl.store(out, acc, mask=fmask[:, None] & emask[None, :])


@triton.jit
def _power_apply(
    X,
    INDEX,
    WEIGHT,
    STATE,
    SCALE,
    OUT,
    rows,
    d,
    dv,
    D,
    chunk,
    n_chunks,
    n_mblocks,
    groups,
    P: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    mblock = pid % n_mblocks
    h = pid // n_mblocks
    i = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < rows
    c = (mblock * BLOCK_M) // chunk
    e = tl.arange(0, BLOCK_DV)
    emask = e < dv
    state = STATE + ((h // groups) * n_chunks + c) * D * dv
    scale = tl.load(SCALE + h * rows + i, mask=imask, other=0.0)
    live = imask & (scale != 0)  # a zero scale (a padded key's dV) reads nothing
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for f0 in range(0, D, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        fmask = f < D
        feats = _features(X + (h * rows + i) * d, live, INDEX, f, fmask, D, P, BLOCK_M, BLOCK_F)
        if WEIGHTED:
            feats = feats * tl.load(WEIGHT + f, mask=fmask, other=0.0)[None, :]
        block = tl.load(state + f[:, None] * dv + e[None, :], mask=fmask[:, None] & emask[None, :], other=0.0)
        acc = tl.dot(feats.to(DOT), block.to(DOT), acc, input_precision=PRECISION)
    acc = acc * scale[:, None]
    out = OUT + (h * rows + i)[:, None] * dv + e[None, :]
    omask = imask[:, None] & emask[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=omask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=omask)


@triton.jit
def _power_grad(
    X,
    Y,
    INDEX,
    WEIGHT,
    STATE,
    SCALE,
    DX,
    rows,
    d,
    dv,
    D,
    chunk,
    n_chunks,
    n_mblocks,
    groups,
    P: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    mblock = pid % n_mblocks
    h = pid // n_mblocks
    i = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < rows
    c = (mblock * BLOCK_M) // chunk
    e = tl.arange(0, BLOCK_DV)
    emask = e < dv
    scale = tl.load(SCALE + h * rows + i, mask=imask, other=0.0)
    live = imask & (scale != 0)
    y = tl.load(Y + (h * rows + i)[:, None] * dv + e[None, :], mask=live[:, None] & emask[None, :], other=0.0)
    state = STATE + ((h // groups) * n_chunks + c) * D * dv
    xrow = X + (h * rows + i) * d
    coordinates = tl.arange(0, BLOCK_D)
    dx = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for f0 in range(0, D, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        fmask = f < D
        block = tl.load(state + f[:, None] * dv + e[None, :], mask=fmask[:, None] & emask[None, :], other=0.0)
        g = tl.dot(y.to(DOT), tl.trans(block).to(DOT), input_precision=PRECISION)  # (BLOCK_M, BLOCK_F)
        if WEIGHTED:
            g = g * tl.load(WEIGHT + f, mask=fmask, other=0.0)[None, :]
        for level in tl.static_range(P):  # d m_f / d x_{INDEX[level, f]}: the product of the other coordinates
            part = g
            for other in tl.static_range(P):
                if other != level:
                    idx = tl.load(INDEX + other * D + f, mask=fmask, other=0)
                    part = part * tl.load(
                        xrow[:, None] + idx[None, :], mask=live[:, None] & fmask[None, :], other=0.0
                    ).to(tl.float32)
            idx = tl.load(INDEX + level * D + f, mask=fmask, other=-1)
            onehot = tl.where(idx[:, None] == coordinates[None, :], 1.0, 0.0)  # (BLOCK_F, BLOCK_D)
            dx = tl.dot(part.to(DOT), onehot.to(DOT), dx, input_precision=PRECISION)
    dx = dx * scale[:, None]
    tl.store(
        DX + (h * rows + i)[:, None] * d + coordinates[None, :],
        dx.to(DX.dtype.element_ty),
        mask=imask[:, None] & (coordinates < d)[None, :],
    )
