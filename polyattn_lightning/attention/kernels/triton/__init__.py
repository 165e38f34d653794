"""``triton``: fused Triton attention for the built-in elementwise activations (CUDA).

Files: ``backend.py`` (what the backend takes and why not the rest), ``launch.py`` (tile tables and launches),
``jit.py`` (the ``@triton.jit`` programs), ``op.py`` (operators and autograd), ``selfcheck.py`` (each compiled
configuration checked once against the blocked kernel); ``power_jit.py`` and ``power_op.py`` are the CUDA parallel
form of the ``power`` backend.

One program holds a block of queries (or, in the key/value backward, a block
of keys) and walks the other side block by block; ``S``, ``phi(S)`` and
``phi'(S)`` live only in fp32 registers, never in memory. No softmax means no
running max and no row statistics: the forward simply adds key blocks, and the
backward needs no ``rowsum(dO * O)`` term. The backward is two kernels, one
accumulating ``dK, dV`` per key block and one ``dQ`` per query block, so no
atomics are needed.

Supported: ``poly{p}``, ``relu``, ``softplus``, ``sigmoid`` (an Activation's
``kernel`` form), fp16 / bf16 / fp32 operands, head dims up to 256, any
boolean ``allowed`` mask (key padding or pairwise, read through broadcast
strides), causal masking (``CAUSAL``: query ``i`` attends keys ``j <= i + OFFSET``,
``OFFSET = Nk - Nq``; each program's tile loop stops at, or starts from, the
diagonal, so tiles above it are never computed, and only those it crosses are masked), an additive score bias (Swin's
relative-position bias; read through
broadcast strides, its gradient summed over the dimensions it broadcasts
along), attention dropout, ragged lengths and ``Nq != Nk``.

Dropout: pair (query ``i``, key ``j``) of flattened head ``bh`` is kept iff
word ``j % 4`` of ``tl.philox(seed, j // 4, i, bh, 0)`` (Philox4x32-10) is
``>= floor(p * 2**32)``, the scheme of the C++ kernel (``kernels/fused_cpu.py``). Each
Philox call yields the four words of four neighbouring keys. No mask is
stored: each kernel regenerates it. The 64-bit seed is drawn per call on
``q``'s device (``draw_seed``: CUDA's default generator, so no host copy and no
stream sync, and safe under CUDA-graph capture); the C++ kernel draws its seed
from the CPU generator, so the two kernels do not drop the same pairs for the
same ``torch.manual_seed`` (each repeats itself; ExactResume restores both
generators).

The bias gradient is written as a ``(B*H, Nq, Nk)`` fp32 buffer by the ``dQ``
kernel and then summed over the bias's broadcast dimensions: O(B H Nq Nk)
memory, only when the bias requires grad (Swin's 7x7 windows: small).

Precision of the six products (``q k^T``, ``P V``, ``P^T dO``, ``dO V^T``,
``dS^T q``, ``dS k``), all accumulated in fp32:

============  ==========================  =====================================
inputs        ``q k^T``                   the other five
============  ==========================  =====================================
bf16          bf16 tensor cores           bf16 tensor cores
fp16          fp16 tensor cores           TF32 tensor cores on fp32 operands
fp32          ``fp32_precision()``        ``fp32_precision()``
============  ==========================  =====================================

fp16's range (65504) cannot hold ``phi(S)`` (``S^3`` overflows at ``|S| > 40``),
so fp16 inputs keep those products on fp32 operands, in TF32 (fp32's range,
fp16's 10-bit mantissa). fp32 inputs follow
``torch.get_float32_matmul_precision()``: ``'highest'`` (PyTorch's default) is
IEEE fp32, which Triton runs without tensor cores (still far ahead of the blocked
kernel's tile loop on a GPU: docs/benchmarks/gpu-h200.md); ``'high'`` is ``tf32x3``
(three TF32 products, about fp32 accuracy) and ``'medium'`` is ``tf32``.

Launches: a 1-D grid whose program id runs over a head's query (or key)
blocks first, so the programs running at the same time share one head's K and
V in L2 (and B*H is not capped by CUDA's 65535 on grid axes 1 and 2); tile sizes
come from the tables of ``launch.py``.

The launches are ``torch.library.triton_op`` operators (``op.py``), so
``torch.compile`` can see through them without a graph break
(``test_triton_cuda.py`` checks this on a GPU; the interpreter cannot be traced
by torch.compile). ``attention()`` checks each compiled configuration once
against the blocked kernel before trusting it (``selfcheck.py``). The
interpreter multiplies bf16 as raw integers, so under it bf16 products run on
fp32 operands (bf16 loads, stores and casts are still exercised). What has run
on which GPU is in docs/benchmarks/kernels-cuda.md.
"""

from .backend import BACKEND, DTYPES, MAX_HEAD_DIM, Triton, triton_available
from .launch import fp32_precision, interpreting

__all__ = ["BACKEND", "DTYPES", "MAX_HEAD_DIM", "Triton", "fp32_precision", "interpreting", "triton_available"]
