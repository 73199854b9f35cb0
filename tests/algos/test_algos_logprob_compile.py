"""`use_torch_compile=True` of the chunked log-prob / entropy: same numbers as the eager path,
and the flag really switches to the compiled per-chunk functions.

Inductor on CPU needs a C++ compiler; without one (or if the first compile fails) the
compiled tests skip with the reason. Tiny vocab and few (dtype, temperature) cases keep the
compile time small (each compiled function recompiles per dtype, for T == 1 vs other T, and
for 1-row chunks).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from verl_async.algos import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from verl_async.algos import logprob as logprob_mod

V = 37


@pytest.fixture(scope="module")
def compiled_ok():
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        pytest.skip("torch.compile (inductor) on CPU needs a C++ compiler: no g++/c++/clang++ on PATH")
    try:
        logprobs_and_entropy(torch.randn(4, V), torch.randint(0, V, (4,)), 1.0, 3, use_torch_compile=True)
    except Exception as e:  # backend failure at first use (no compiler headers, no OpenMP, ...)
        pytest.skip(f"torch.compile does not work here: {type(e).__name__}: {str(e)[:300]}")


def _case(dtype, seed=0, shape=(3, 11)):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, shape, generator=g)
    w = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    return logits, labels, w


def _values_and_grad(fn, logits, w):
    x = logits.clone().requires_grad_()
    out = fn(x)
    out = out if isinstance(out, tuple) else (out,)
    (grad,) = torch.autograd.grad(sum((o * wi.to(o.dtype)).sum() for o, wi in zip(out, w)), x)
    return [o.detach() for o in out], grad


# fp32: the summation order differs (inductor's vectorised / fused sums), so values of
# magnitude ~5-15 (logits ~3 sigma at T=0.7) differ by a few to ~20 ulps, and the entropy
# gradient's (E_p[x] - x) inherits that; the eager path is no closer to the float64 truth.
FP32_TOL = dict(atol=1e-5, rtol=1e-6)
GRAD_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)])
def test_compiled_matches_eager_values_and_grads(compiled_ok, dtype, temperature):
    logits, labels, w = _case(dtype)
    for chunk in (4, 16, None):  # 33 rows: 4 -> last chunk of 1 row; 16 -> 16, 16, 1; None -> one chunk
        for fn_name, fn in (
            ("both", lambda x, c: logprobs_and_entropy(x, labels, temperature, chunk, use_torch_compile=c)),
            ("logp", lambda x, c: logprobs_from_logits(x, labels, temperature, chunk, use_torch_compile=c)),
            ("ent", lambda x, c: entropy_from_logits(x, chunk, temperature, use_torch_compile=c)),
        ):
            if fn_name != "both" and (dtype, temperature) != (torch.float32, 0.7):
                continue  # keeps compiles few (each case is another graph); one case covers these kernels
            eager, g_eager = _values_and_grad(lambda x: fn(x, False), logits, w)
            comp, g_comp = _values_and_grad(lambda x: fn(x, True), logits, w)
            for e, c in zip(eager, comp):
                assert c.dtype == e.dtype == torch.float32
                # math is fp32 for bf16 logits too: only the summation order differs
                torch.testing.assert_close(c, e, **FP32_TOL)
            assert g_comp.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(g_comp, g_eager, **GRAD_TOL)
            else:  # one bf16 rounding of the same fp32 value: at most one bf16 ulp apart
                torch.testing.assert_close(g_comp.float(), g_eager.float(), atol=1e-6, rtol=2 ** -7)


def test_compiled_masked_vocab_and_only_one_output_used(compiled_ok):
    logits = torch.randn(6, V)
    logits[:, :5] = float("-inf")
    logits[0] = float("-inf")  # a fully masked row: -inf log-prob, no NaN in the other rows
    labels = torch.arange(6) + 5
    x = logits.clone().requires_grad_()
    lp, ent = logprobs_and_entropy(x, labels, 1.0, 4, use_torch_compile=True)
    elp, eent = logprobs_and_entropy(logits, labels, 1.0, 4)
    torch.testing.assert_close(lp, elp, **FP32_TOL, equal_nan=True)
    torch.testing.assert_close(ent, eent, **FP32_TOL, equal_nan=True)
    lp[1:].sum().backward()  # only logp used: the logp-only backward kernel
    y = logits.clone().requires_grad_()
    logprobs_and_entropy(y, labels, 1.0, 4)[0][1:].sum().backward()
    torch.testing.assert_close(x.grad[1:], y.grad[1:], **GRAD_TOL)
    assert float(x.grad[1:, :5].abs().sum()) == 0.0


def test_compiled_float64_stays_float64(compiled_ok):
    logits, labels, w = _case(torch.float64, seed=3, shape=(2, 5))
    eager, ge = _values_and_grad(lambda x: logprobs_and_entropy(x, labels, 1.3, 3), logits, w)
    comp, gc = _values_and_grad(lambda x: logprobs_and_entropy(x, labels, 1.3, 3, use_torch_compile=True), logits, w)
    assert comp[0].dtype == torch.float64
    for e, c in zip(eager, comp):
        torch.testing.assert_close(c, e, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(gc, ge, atol=1e-12, rtol=1e-12)


def test_flag_switches_the_path(monkeypatch):
    """use_torch_compile=True calls the (cached, once per process) compiled per-chunk functions,
    False never touches them; checked with counting stand-ins, so no compiler is needed."""
    calls: dict[str, int] = {}

    def counting(name, f):
        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            return f(*args)
        return wrapper

    fake = logprob_mod._ChunkFns(*(counting(f.__name__, f) for f in logprob_mod._EAGER_FNS))
    monkeypatch.setattr(logprob_mod, "compiled_chunk_fns", lambda: fake)
    logits, labels, w = _case(torch.float32)

    _values_and_grad(lambda x: logprobs_and_entropy(x, labels, 0.7, 8), logits, w)
    _values_and_grad(lambda x: logprobs_from_logits(x, labels, 0.7, 8), logits, w)
    assert calls == {}  # eager path: no per-chunk function of the compiled path runs

    eager, ge = _values_and_grad(lambda x: logprobs_and_entropy(x, labels, 0.7, 8), logits, w)
    comp, gc = _values_and_grad(lambda x: logprobs_and_entropy(x, labels, 0.7, 8, use_torch_compile=True),
                                logits, w)
    assert calls == {"_fwd_both": 5, "_bwd_both": 5}  # 33 rows in chunks of 8
    _values_and_grad(lambda x: logprobs_from_logits(x, labels, 0.7, 8, use_torch_compile=True), logits, w)
    _values_and_grad(lambda x: entropy_from_logits(x, 8, 0.7, use_torch_compile=True), logits, w)
    assert calls["_fwd_logp"] == calls["_bwd_logp"] == calls["_fwd_ent"] == calls["_bwd_ent"] == 5
    # the pure per-chunk functions run eagerly give the same numbers as the eager path
    for e, c in zip(eager, comp):
        torch.testing.assert_close(c, e, **FP32_TOL)
    torch.testing.assert_close(gc, ge, **GRAD_TOL)


def test_compiled_functions_are_built_once():
    fns = logprob_mod.compiled_chunk_fns()
    assert fns is logprob_mod.compiled_chunk_fns()
    assert all(f is not e for f, e in zip(fns, logprob_mod._EAGER_FNS))  # torch.compile wrappers


def test_chunk_bounds_avoid_one_row_chunks():
    rows = lambda n, c: [s.stop - s.start for s in logprob_mod._chunk_bounds(n, c)]  # noqa: E731
    assert rows(33, 8) == [8, 8, 8, 7, 2] and rows(32, 8) == [8] * 4 and rows(33, 16) == [16, 15, 2]
    assert rows(1, 8) == [1] and rows(5, 1) == [1] * 5 and rows(5, 2) == [2, 2, 1] and rows(4, 3) == [2, 2]


def test_recompile_limit_falls_back_to_the_eager_function(monkeypatch, caplog):
    exc = torch._dynamo.exc.FailOnRecompileLimitHit

    def over_the_limit(*args):
        raise exc("Hard failure due to fullgraph=True")

    call = logprob_mod._with_eager_fallback(over_the_limit, logprob_mod._fwd_both)
    monkeypatch.setattr(logprob_mod, "_FALLBACK_WARNED", set())
    logits, labels, _ = _case(torch.float32)
    x, lab = logits.reshape(-1, V), labels.reshape(-1)
    with caplog.at_level("WARNING"):
        out = call(x, lab, 0.7)
        call(x, lab, 0.7)
    assert [r for r in caplog.records if "recompile_limit" in r.getMessage()].__len__() == 1
    torch.testing.assert_close(out[1], logprobs_from_logits(x, lab, 0.7), **FP32_TOL)
