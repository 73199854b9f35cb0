"""The static-decode path (CUDA-graph buffers, batch / KV-length buckets, padding rows) on CPU.

CUDA graphs need a GPU; here a stand-in "graph" replays the captured step body eagerly, so
everything around the capture (static buffers, bucketed masks, padded rows, logits buffer,
lazy capture per bucket, warmup) is checked for exact numbers on CPU.
"""

from __future__ import annotations

import asyncio
import functools

import torch

from verl_async.models.loading import load_causal_lm
from verl_async.rollout.engine import GenerateRequest, SamplingParams
from verl_async.rollout.native import NativeEngine
from verl_async.rollout.native.runner import ModelRunner, batch_buckets
from verl_async.utils.device import resolve


class EagerReplayRunner(ModelRunner):
    """A runner whose 'graphs' replay the step body eagerly (CPU stand-in for CUDA graphs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._enable_static_decode()
        self.captured: list[tuple[int, int]] = []

    def _new_graph(self, batch, kv_len):
        self.captured.append((batch, kv_len))
        return functools.partial(self._graph_body, batch, kv_len)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    b = batch_buckets(256)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256 and b == sorted(set(b))


def test_static_decode_path_gives_exact_log_probs(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir).eval().requires_grad_(False)

    async def main():
        eng = NativeEngine(model=model, max_num_seqs=5, max_model_len=64)
        eng._runner = EagerReplayRunner(model, device=resolve("cpu"), num_slots=5, slot_len=64, kv_len_bucket=16)
        try:
            assert await eng.warmup(2, 40) == 2 * 3  # batch buckets {1, 2} x kv buckets {16, 32, 48}
            reqs = [
                GenerateRequest(f"s{i}", [7 + i] * (2 + 3 * i), SamplingParams(temperature=0.9, max_tokens=9 + 8 * i, ignore_eos=True))
                for i in range(5)
            ]
            return reqs, await asyncio.gather(*[eng.generate(r) for r in reqs]), eng._runner.captured
        finally:
            await eng.shutdown()

    reqs, results, captured = asyncio.run(asyncio.wait_for(main(), 60))
    assert {kv for _, kv in captured} <= {16, 32, 48, 64} and any(b == 5 for b, _ in captured)
    for r, res in zip(reqs, results):
        assert res.ok and len(res.token_ids) == r.sampling.max_tokens
        ids = torch.tensor([r.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits / 0.9, -1).gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
        assert (ref - torch.tensor(res.log_probs)).abs().max().item() < 1e-4


def test_the_hf_forward_gets_the_cache_by_the_keyword_it_takes_and_warns_nothing(tiny_model_dir):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns on every forward, 126 times a demo);
    the floor (4.56.2) knows only the old name and would drop `cache` into **kwargs, attending to nothing cached.
    Decoding through the HF forward (fast decode off) must match a full forward exactly, without a warning."""
    import inspect
    import warnings

    from verl_async.rollout.native.runner import cache_keyword

    model = load_causal_lm(tiny_model_dir).eval().requires_grad_(False)
    takes_cache = "cache" in inspect.signature(model.forward).parameters
    assert cache_keyword(model) == ("cache" if takes_cache else "past_key_values")
    runner = ModelRunner(model, device=resolve("cpu"), num_slots=2, slot_len=32, fast_decode=False)
    prompts = [[5, 9, 14, 3], [7, 2]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (or any other) fails the test
        last = runner.prefill(prompts, [0, 1])
        nxt = last.argmax(-1)
        runner.set_rows([0, 1], nxt, [len(p) for p in prompts])
        step = runner.decode(2, max(len(p) for p in prompts))
    for row, p in enumerate(prompts):
        full = model(input_ids=torch.tensor([p + [int(nxt[row])]])).logits[0].float()
        torch.testing.assert_close(last[row], full[-2], rtol=0, atol=1e-5)
        torch.testing.assert_close(step[row], full[-1], rtol=0, atol=1e-5)
