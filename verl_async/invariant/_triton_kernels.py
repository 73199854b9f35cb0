"""The Triton kernels behind `triton_ops` (imported only from there, and only when a kernel is called).

Why a row's bits cannot depend on its batch:
- matmul: one program per [BLOCK_M, BLOCK_N] output tile, K walked in BLOCK_K steps from 0 upwards into one
  float32 accumulator (no split-K, no stream-K, no atomics). BLOCK_K is chosen from the weight's dtype alone, so
  every output is the same sequence of `tl.dot`s over the same K slices, whatever rows share its tile and wherever
  it sits in it. Rows past M are loaded as zeros; they change no other row. M is not specialized
  (`do_not_specialize`). The tile's M and N sizes, warps and stages are a decode call's own (`matmul_config`: a
  few rows spread over more programs): on a GPU `tl.dot` chains each output's products in K order whatever the
  tile (measured: BLOCK_M 128/64/32/16 give equal bits; `triton_ops.DECODE_TILE_ENV=off` keeps one tile).
- RMSNorm: one program per row; the row's squares are added into a BLOCK-wide float32 vector chunk by chunk in
  order and the vector reduced once by `tree_sum` (a pairwise tree over logical indices, fixed by BLOCK, a
  function of the hidden size only; `tl.sum`'s order would follow the register layout, which the compiler picks
  from the input's dtype and alignment).
- attention and the sampled-token log-prob: see `triton_softmax` and the kernels' docstrings.
- rotary (`rope_cache_kernel`, `invariant.rope`): elementwise, each element rounded where HF's formula rounds it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def linear_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  ADD_TO_OUT: tl.constexpr):
    # Grouped tile order (tiles of GROUP_M row blocks share weight tiles in L2): which program computes a tile
    # never changes what the tile's arithmetic is.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M x N passes 2**31 at 16k rows x 152k vocab
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # the [BLOCK_K, BLOCK_N] tile of w.T
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & col_ok, other=0.0)
        if UPCAST:  # interpreter only: its tl.dot multiplies bfloat16's raw uint16 storage (exact in float32 anyway)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:  # float32 inputs: float32 products, as torch's default (no TF32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = o_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    out = acc.to(o_ptr.dtype.element_ty)
    if ADD_TO_OUT:  # out += x @ w.T as torch's `residual + linear(x)`: the product rounded, then the sum rounded
        res = tl.load(o_ptrs, mask=row_ok & col_ok, other=0.0)
        out = round_to(res.to(tl.float32) + out.to(tl.float32), o_ptr.dtype.element_ty)
    tl.store(o_ptrs, out, mask=row_ok & col_ok)


@triton.jit
def tree_sum(x, N: tl.constexpr, LOG_N: tl.constexpr):
    """The sum of x [N] (N = 2**LOG_N) by a pairwise tree over logical indices: x[i] + x[i + N/2], halving until
    one is left. `tl.sum`'s order follows the register layout, which the compiler picks from the loads' dtype and
    alignment (bf16 and float32 logits, or an odd offset, get other layouts); an add of two is the same in any."""
    for i in tl.static_range(LOG_N):
        x = tl.sum(tl.reshape(x, (2, N >> (i + 1))), axis=0)
    return tl.reshape(x, ())


@triton.jit(do_not_specialize=["M"])
def rms_norm_kernel(x_ptr, w_ptr, o_ptr, M, H, stride_xm, stride_om, eps,
                    BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
    """HF's Llama/Qwen RMSNorm of one row: float32 inside, `h / sqrt(mean(h^2) + eps)` rounded to x's dtype,
    then times the weight (as torch's `weight * normed.to(dtype)`: a float32 product rounded once)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        h = tl.load(x_row + start + cols, mask=start + cols < H, other=0.0).to(tl.float32)
        acc += h * h
    variance = tl.math.div_rn(tree_sum(acc, BLOCK, LOG_BLOCK), H * 1.0)
    denom = tl.sqrt_rn(variance + eps)
    for start in range(0, H, BLOCK):
        ok = start + cols < H
        x = tl.load(x_row + start + cols, mask=ok, other=0.0)
        normed = tl.math.div_rn(x.to(tl.float32), denom).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + start + cols, mask=ok, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(o_ptr + row * stride_om + start + cols, out.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "L", "n_tiles"])
def attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, M, L, R, G, n_tiles, scale, window,
                     sq_s, sq_g, sq_r, sq_m, sk_s, sk_g, sk_l, sv_s, sv_g, sv_l, sp_s, sp_m,
                     so_s, so_g, so_r, so_m,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, WALK_ALL: tl.constexpr):
    """One program per (sequence, KV head, tile of BLOCK_M query rows); rows are (position m, head r) pairs, row
    m * R + r, so decode's R heads of one position share a tile. Keys go by in BLOCK_N blocks from 0 upwards with
    an online softmax in float32. A block in which a row sees no key leaves that row's state untouched (a select,
    not arithmetic that happens to give the same value), so a tile may stop at its last visible block and start at
    its first: each row's result is the sequence of its own visible blocks, whatever rows share the tile.
    WALK_ALL (tests only): every tile walks all L keys, to show that stopping early changes no bit."""
    pid = tl.program_id(0)
    tile = pid % n_tiles
    sg = pid // n_tiles
    s = (sg // G).to(tl.int64)
    g = (sg % G).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M * R
    m_idx = (rows // R).to(tl.int64)
    r_idx = (rows % R).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    pos = tl.load(pos_ptr + s * sp_s + m_idx * sp_m, mask=row_ok, other=-1).to(tl.int64)
    q = tl.load(q_ptr + s * sq_s + g * sq_g + r_idx[:, None] * sq_r + m_idx[:, None] * sq_m + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # The keys any row of the tile sees: [lo, hi) (rows past M*R sit at -1 and see none).
    hi = tl.minimum(tl.max(pos, axis=0) + 1, L).to(tl.int32)
    if WALK_ALL:
        hi = L + hi * 0
    if HAS_WINDOW and not WALK_ALL:
        lo = tl.maximum(tl.min(tl.where(row_ok, pos, hi), axis=0) - window + 1, 0).to(tl.int32)
    else:
        lo = hi * 0
    if UPCAST:  # interpreter only: its tl.dot multiplies bfloat16's raw uint16 storage (exact in float32 anyway)
        q = q.to(tl.float32)
    k_base = k_ptr + s * sk_s + g * sk_g
    v_base = v_ptr + s * sv_s + g * sv_g
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for blk in range(lo // BLOCK_N, tl.cdiv(hi, BLOCK_N)):
        keys = (blk * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        key_ok = (keys >= lo) & (keys < hi)  # columns no row sees load as zeros: no garbage reaches a product
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + keys[:, None] * sk_l + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * sv_l + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        seen = tl.max(visible.to(tl.int32), axis=1) > 0
        m_new = tl.where(seen, tl.maximum(m_i, tl.max(scores, axis=1)), 0.0)  # (rows that see nothing: unused)
        alpha = tl.exp(m_i - m_new)  # m_i = -inf (nothing seen yet): 0
        p = tl.exp(scores - m_new[:, None])  # masked: exp(-inf) = 0 exactly
        p_v = p.to(v_ptr.dtype.element_ty)  # the value GEMM in the input dtype (as flash attention), float32 sums
        if UPCAST:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p_v, v, input_precision="ieee")
        else:
            pv = tl.dot(p_v, v)
        acc = tl.where(seen[:, None], acc * alpha[:, None] + pv, acc)
        l_i = tl.where(seen, l_i * alpha + tl.sum(p, axis=1), l_i)
        m_i = tl.where(seen, m_new, m_i)
    out = tl.where(l_i[:, None] > 0, tl.math.div_rn(acc, tl.where(l_i > 0, l_i, 1.0)[:, None]), 0.0)
    o_ptrs = o_ptr + s * so_s + g * so_g + r_idx[:, None] * so_r + m_idx[:, None] * so_m + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def logprob_kernel(x_ptr, label_ptr, lse_ptr, logp_ptr, ent_ptr, N, V, stride_x, inv_t,
                   WITH_LOGP: tl.constexpr, WITH_ENT: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                   LOG_BLOCK: tl.constexpr):
    """One program per row: x = logits * (1 / T) in float32, walked in BLOCK-wide chunks from column 0 with a
    running maximum; lane i keeps its own running sum of exp(x - max) over columns i, i + BLOCK, ... (and of
    exp(x - max) * x for the entropy), rescaled when the maximum grows, and the lanes are added once at the end
    by `tree_sum` (an order fixed by BLOCK, a function of the vocab only)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.zeros((BLOCK,), dtype=tl.float32)
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        if SCALE:
            x = x * inv_t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: nothing to add yet
        alpha = tl.exp(m - shift)
        e = tl.exp(x - shift)
        z = z * alpha + e
        if WITH_ENT:
            t = t * alpha + e * tl.where(e > 0, x, 0.0)  # -inf logits: 0 * -inf counts as 0
        m = m_new
    total = tree_sum(z, BLOCK, LOG_BLOCK)
    lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(total)  # a row of -inf only: -inf, not NaN
    tl.store(lse_ptr + row, lse)
    if WITH_LOGP:
        label = tl.load(label_ptr + row)
        xl = tl.load(base + label).to(tl.float32)
        if SCALE:
            xl = xl * inv_t
        tl.store(logp_ptr + row, xl - lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, lse - tl.math.div_rn(tree_sum(t, BLOCK, LOG_BLOCK), total))


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded once to DTYPE, to nearest even (as torch's casts). bfloat16 by its bits: Triton's
    interpreter truncates a float32 -> bfloat16 cast, a GPU rounds it; this gives both the GPU's (NaN kept)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x).to(tl.bfloat16)
    return x.to(DTYPE)


@triton.jit
def _rotate_store(src, dst, j, ok, c1, c2, s1, s2, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """HF's `x * cos + rotate_half(x) * sin` for one head: each product and the sum rounded to DTYPE
    (16-bit inputs: the float32 products are exact, so each is rounded once, as torch's ops do)."""
    x1 = tl.load(src + j, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=ok, other=0.0).to(tl.float32)
    lo = round_to(x1 * c1, DTYPE).to(tl.float32) + round_to((-x2) * s1, DTYPE).to(tl.float32)
    hi = round_to(x2 * c2, DTYPE).to(tl.float32) + round_to(x1 * s2, DTYPE).to(tl.float32)
    tl.store(dst + j, round_to(lo, DTYPE), mask=ok)
    tl.store(dst + HALF + j, round_to(hi, DTYPE), mask=ok)


@triton.jit
def rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr, H,
                      sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b, ss_b, so_b, so_h,
                      skc_s, skc_g, skc_l, svc_s, svc_g, svc_l,
                      HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row b, head): query heads 0..H-1 rotated into qo; KV head g = head - H rotated into the
    key cache at (slot b, g, position pos[b]), its value copied into the value cache there."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    c1 = tl.load(cos_ptr + b * sc_b + j, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * sc_b + HALF + j, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * ss_b + j, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * ss_b + HALF + j, mask=ok, other=0.0).to(tl.float32)
    dtype = qo_ptr.dtype.element_ty
    if head < H:
        _rotate_store(q_ptr + b * sq_b + head * sq_h, qo_ptr + b * so_b + head * so_h, j, ok, c1, c2, s1, s2,
                      HALF, dtype)
    else:
        g = (head - H).to(tl.int64)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        _rotate_store(k_ptr + b * sk_b + g * sk_h, kc_ptr + b * skc_s + g * skc_g + pos * skc_l, j, ok,
                      c1, c2, s1, s2, HALF, dtype)
        v_src = v_ptr + b * sv_b + g * sv_h
        v_dst = vc_ptr + b * svc_s + g * svc_g + pos * svc_l
        tl.store(v_dst + j, tl.load(v_src + j, mask=ok), mask=ok)
        tl.store(v_dst + HALF + j, tl.load(v_src + HALF + j, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["N"])
def logprob_backward_kernel(x_ptr, label_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, gx_ptr, N, V, stride_x,
                            stride_g, inv_t, HAS_LOGP: tl.constexpr, HAS_ENT: tl.constexpr, SCALE: tl.constexpr,
                            BLOCK: tl.constexpr):
    """The logits' gradient of `logprob_kernel`'s outputs, one program per row in one pass over the vocab (what
    `algos.logprob.eager_backward` computes in ~10 passes over float32 copies): with p = exp(x / T - lse),
    d logp / dx = (onehot(label) - p) / T and d H / dx = p (E_p[x] - x) / T, E_p[x] = lse - H. A gradient need
    not match anything bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    out = gx_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    if HAS_ENT:
        mean_x = lse - tl.load(ent_ptr + row)
        g_ent = tl.load(gent_ptr + row)
    if HAS_LOGP:
        g_logp = tl.load(glogp_ptr + row)
        label = tl.load(label_ptr + row)
    for start in range(0, V, BLOCK):
        ok = start + cols < V
        x = tl.load(base + start + cols, mask=ok, other=0.0).to(tl.float32)
        if SCALE:
            x = x * inv_t
        p = tl.exp(x - lse)
        g = tl.zeros((BLOCK,), dtype=tl.float32)
        if HAS_ENT:
            g = p * tl.where(p > 0, mean_x - x, 0.0) * g_ent  # a -inf logit: p = 0 and no 0 * inf
        if HAS_LOGP:
            g = g - p * g_logp + tl.where(start + cols == label, g_logp, 0.0)
        if SCALE:
            g = g * inv_t
        tl.store(out + start + cols, g.to(gx_ptr.dtype.element_ty), mask=ok)
