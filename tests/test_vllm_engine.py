"""vLLM engine adapter: config mapping, log-prob extraction and the worker extension run here (no vLLM);
the engine itself runs where vLLM and a GPU are (marked gpu + vllm; scripts/device/run_all_gpu.sh)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from verl_async.rollout.engine import GenerateRequest, SamplingParams
from verl_async.rollout.vllm_engine import WORKER_EXTENSION, engine_args_from_config, sampled_logprobs, vllm_sampling_kwargs
from verl_async.rollout.vllm_worker import WeightSyncWorkerExtension
from verl_async.sync.buckets import plan_buckets, plan_to_wire
from verl_async.sync.collective import WeightSyncGroup, engine_side, master_store, send_buckets

ROLLOUT = {
    "name": "vllm", "dtype": "bfloat16", "prompt_length": 128, "response_length": 384, "tensor_model_parallel_size": 2,
    "gpu_memory_utilization": 0.4, "max_num_seqs": 32, "max_num_batched_tokens": 4096, "enable_chunked_prefill": True,
    "enable_prefix_caching": True, "enforce_eager": False, "seed": 3, "load_format": "auto", "disable_log_stats": True,
    "free_cache_engine": True, "engine_kwargs": {"vllm": {"compilation_config": {"mode": 0}}, "native": {"x": 1}},
}


# ------------------------------------------------------------------------------------------ no vLLM needed
def test_importing_verl_async_never_imports_vllm():
    code = ("import sys, verl_async, verl_async.rollout.registry as r, verl_async.rollout.vllm_engine, "
            "verl_async.rollout.vllm_worker, verl_async.pipeline; r.engine_class('vllm'); "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("False")


def test_engine_args_follow_the_verl_rollout_keys():
    args = engine_args_from_config(ROLLOUT, model_path="/m", trust_remote_code=True, override_config={"a": 1},
                                   seed=9)
    assert args["model"] == "/m" and args["trust_remote_code"] is True and args["hf_overrides"] == {"a": 1}
    assert args["max_model_len"] == 512  # prompt_length + response_length
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    assert (args["gpu_memory_utilization"], args["max_num_seqs"], args["max_num_batched_tokens"]) == (0.4, 32, 4096)
    assert args["enable_chunked_prefill"] is True and args["enforce_eager"] is False
    assert args["logprobs_mode"] == "processed_logprobs"  # log-probs after temperature (verl #6240)
    assert args["worker_extension_cls"] == WORKER_EXTENSION and args["skip_tokenizer_init"] is True
    assert args["compilation_config"] == {"mode": 0} and "x" not in args  # engine_kwargs.vllm only
    assert args["seed"] == 9  # explicit overrides win
    one = engine_args_from_config({**ROLLOUT, "tensor_model_parallel_size": 1, "enable_chunked_prefill": False,
                                   "max_num_batched_tokens": 256}, model_path="/m")
    assert one["distributed_executor_backend"] == "uni"
    assert one["max_num_batched_tokens"] == 512  # no chunked prefill: a step must hold a whole prompt


def test_sampling_kwargs_ask_for_the_sampled_token_log_prob():
    sp = SamplingParams(temperature=0.7, top_p=1.0, top_k=-1, max_tokens=50, stop_token_ids=(5,), seed=11)
    kw = vllm_sampling_kwargs(sp, remaining=20)
    assert kw["max_tokens"] == 20 and kw["logprobs"] == 0 and kw["top_k"] == 0 and kw["temperature"] == 0.7
    assert kw["stop_token_ids"] == [5] and kw["seed"] == 11 and kw["detokenize"] is False
    assert vllm_sampling_kwargs(SamplingParams(top_k=8), 1)["top_k"] == 8


def test_sampled_logprobs_from_flat_and_dict_formats():
    flat = SimpleNamespace(start_indices=[0, 1, 3], end_indices=[1, 3, 4], token_ids=[7, 9, 4, 2],
                           logprobs=[-0.5, -1.5, -0.25, -2.0])
    assert sampled_logprobs(flat, [7, 4, 2]) == [-0.5, -0.25, -2.0]
    dicts = [{7: SimpleNamespace(logprob=-0.5)}, {4: SimpleNamespace(logprob=-0.25), 9: SimpleNamespace(logprob=-3)}]
    assert sampled_logprobs(dicts, [7, 4]) == [-0.5, -0.25]
    with pytest.raises(RuntimeError, match="no log-probs"):
        sampled_logprobs(None, [1])


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):  # vLLM's signature: an iterable of (HF name, tensor)
        for name, t in weights:
            self.loaded[name] = t.clone()


class _Worker(WeightSyncWorkerExtension):
    """Stands in for vLLM's GPU worker: what the extension uses of it."""

    def __init__(self, rank: int):
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=_Model())


def test_worker_extension_joins_receives_and_loads_on_every_tp_rank():
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(40, 8, generator=g).bfloat16(),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).bfloat16(),
               "model.norm.weight": torch.randn(8, generator=g).bfloat16()}
    plan = plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], 300)
    store, port = master_store("127.0.0.1", 20)
    workers = [_Worker(0), _Worker(1)]  # one replica with tensor_model_parallel_size=2, group ranks 1 and 2
    out: dict = {}

    def sender():
        group = WeightSyncGroup("gloo", "", 0, 0, 3, 20, store=store, name="v")
        group.handshake()
        out["sent"] = send_buckets(group, plan, iter(tensors.items()), verify=True)

    def worker(w):
        rank = w.verl_async_join_weight_sync("127.0.0.1", port, 1, 3, "gloo", 20, "v")
        out[rank] = w.verl_async_receive_weights(plan_to_wire(plan), True, True)
        w.verl_async_leave_weight_sync()

    threads = [threading.Thread(target=sender)] + [threading.Thread(target=worker, args=(w,)) for w in workers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(k for k in out if isinstance(k, int)) == [1, 2]
    for rank, w in zip((1, 2), workers):
        assert out[rank]["checksums"] == out["sent"]["checksums"] and out[rank]["tensors"] == 3
        for name, t in tensors.items():
            assert torch.equal(w.model_runner.model.loaded[name], t)
    # object-store path: one bucket of packed host tensors through collective_rpc
    from verl_async.rollout.vllm_worker import pack_tensor

    w = _Worker(0)
    assert w.verl_async_load_bucket([(name, *pack_tensor(t)) for name, t in tensors.items()]) == 3
    assert torch.equal(w.model_runner.model.loaded["model.norm.weight"], tensors["model.norm.weight"])
    # vLLM's msgpack hands the rows over as lists; odd dtypes and shapes survive the packing
    odd = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5)}
    wire = [[name, *pack_tensor(t)] for name, t in {**tensors, **odd}.items()]
    assert w.verl_async_load_bucket(wire) == 6
    for name, t in {**tensors, **odd}.items():
        got = w.model_runner.model.loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    with pytest.raises(RuntimeError, match="before join"):
        w.verl_async_receive_weights(plan_to_wire(plan))


class _FakeAsyncLLM:
    """vLLM's AsyncLLM as far as VLLMEngine uses it: tokens t = (last + 1) % 50 with log-prob -t/100."""

    def __init__(self, engine_args):
        self.args = engine_args.kwargs
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=self.args["max_model_len"]))
        self.aborted: set[str] = set()
        self.worker = _Worker(0)
        self.calls: list[str] = []
        self.reset_results: list = []  # what reset_prefix_cache returns next (then True, as vLLM >= 0.11)

    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(engine_args)

    async def generate(self, prompt, sp, request_id):
        ids, out = list(prompt["prompt_token_ids"]), []
        reason = "length"
        while len(out) < sp.kw["max_tokens"]:
            if request_id in self.aborted:
                reason = "abort"
                break
            out.append((ids + out)[-1] % 50 + 1)
            if out[-1] in sp.kw["stop_token_ids"]:
                reason = "stop"
                break
            await asyncio.sleep(0.001)
        flat = SimpleNamespace(start_indices=list(range(len(out))), end_indices=list(range(1, len(out) + 1)),
                               token_ids=list(out), logprobs=[-t / 100 for t in out])
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=out, logprobs=flat, finish_reason=reason)])

    async def abort(self, ids):
        self.aborted.update(ids)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return [getattr(self.worker, method)(*args)]

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.reset_results.pop(0) if self.reset_results else True

    def shutdown(self):
        self.calls.append("shutdown")


@pytest.fixture
def fake_vllm(monkeypatch):
    """Just enough of vLLM's modules for VLLMEngine (import paths as in vLLM 0.26)."""
    from tests.fakes import install_fake_vllm

    return install_fake_vllm(monkeypatch, _FakeAsyncLLM)


def test_vllm_engine_adapter_logic_with_a_stand_in_async_llm(fake_vllm):
    from verl_async.rollout.vllm_engine import VLLMEngine

    async def main():
        engine = VLLMEngine.from_config({"name": "vllm", "max_model_len": 64, "free_cache_engine": True},
                                        model_path="/m", device="cuda")
        assert engine.llm is None  # AsyncLLM is built inside the event loop
        sp = SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=(99,))
        res = await engine.generate(GenerateRequest("r1", [3], sp))
        assert res.token_ids == list(range(4, 14)) and res.finish_reason == "length"
        assert res.log_probs == [-t / 100 for t in range(4, 14)] and res.versions == [0] * 10
        # abort returns the partial response; a continuation keeps the prefix and its versions
        long = SamplingParams(max_tokens=40)
        task = asyncio.create_task(engine.generate(GenerateRequest("r2", [3], long)))
        await asyncio.sleep(0.01)
        await engine.abort(None)
        part = await task
        assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 40
        await engine.update_weights([[("model.norm.weight", torch.ones(2))]], 5)
        assert engine.version == 5 and engine.llm.calls[-2:] == ["verl_async_load_bucket", "reset_prefix_cache"]
        cont = await engine.generate(GenerateRequest("r3", [3], long, prefix_token_ids=part.token_ids,
                                                     prefix_log_probs=part.log_probs,
                                                     prefix_versions=[0] * len(part.token_ids)))
        k = len(part.token_ids)
        assert cont.token_ids[:k] == part.token_ids and len(cont.token_ids) == 40
        assert cont.versions == [0] * k + [5] * (40 - k) and cont.finish_reason == "length"
        # a prefix that already ended needs no generation; an overlong prompt is a request error
        stop = SamplingParams(max_tokens=40, stop_token_ids=(7,))
        done = await engine.generate(GenerateRequest("r4", [3], stop, prefix_token_ids=[4, 7], prefix_log_probs=[-1, -1],
                                                     prefix_versions=[1, 1]))
        assert done.finish_reason == "stop" and done.token_ids == [4, 7]
        bad = await engine.generate(GenerateRequest("r5", list(range(70)), long))
        assert not bad.ok and "max_model_len" in bad.error
        assert engine.worker_ranks == 1 and engine.stats().generated_tokens >= 40
        await engine.shutdown()
        assert engine.llm is None

    asyncio.run(main())


def test_a_failed_prefix_cache_reset_fails_the_weight_load(fake_vllm, monkeypatch):
    """vLLM returns False when it cannot reset (KV blocks in use): continuing requests could then
    reuse KV of the old weights. Retried briefly, then the load fails and the version stays."""
    from verl_async.rollout import vllm_engine
    from verl_async.rollout.vllm_engine import PrefixCacheResetError, VLLMEngine

    monkeypatch.setattr(vllm_engine, "PREFIX_RESET_RETRY_S", (0.0, 0.0))
    bucket = [[("model.norm.weight", torch.ones(2))]]

    async def main():
        engine = VLLMEngine.from_config({"name": "vllm", "max_model_len": 64, "free_cache_engine": True},
                                        model_path="/m", device="cuda")
        await engine.start()
        engine.llm.reset_results = [False, False, False]
        with pytest.raises(PrefixCacheResetError, match="v5 .*3 attempts"):
            await engine.update_weights(bucket, 5)
        assert engine.version == 0 and engine.llm.calls.count("reset_prefix_cache") == 3
        engine.llm.reset_results = [False, True]  # freed a moment later: the load succeeds
        await engine.update_weights(bucket, 6)
        assert engine.version == 6 and engine.llm.calls.count("reset_prefix_cache") == 5
        engine.llm.reset_results = [None]  # a vLLM whose reset reports nothing: accepted (warned once)
        await engine.update_weights(bucket, 7)
        assert engine.version == 7
        await engine.shutdown()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ on a GPU with vLLM
def _model_dir(tmp_path, seed: int) -> str:
    from verl_async.models.tiny import build_tiny_model_dir

    # head_dim 64: every vLLM attention backend supports it
    return build_tiny_model_dir(str(tmp_path / f"m{seed}"), hidden_size=256, num_layers=2, num_heads=4,
                                num_kv_heads=2, max_position_embeddings=1024, seed=seed)


def _hf_logprobs(model_dir: str, prompt: list[int], tokens: list[int], temperature: float, device: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from verl_async.algos import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1: -1]
    return logprobs_from_logits(logits, torch.tensor([tokens], device=device), temperature)[0].float().cpu()


def _engine(model_dir: str, **kw):
    from verl_async.rollout.vllm_engine import VLLMEngine

    cfg = {"name": "vllm", "dtype": "bfloat16", "gpu_memory_utilization": 0.25, "max_num_seqs": 16,
           "max_model_len": 512, "enforce_eager": True, "seed": 0, **kw}
    return VLLMEngine.from_config(cfg, model_path=model_dir, device="cuda")


PROMPT = [10, 20, 30, 40, 50, 60, 70]


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_logprobs_abort_continue_and_object_store_weights(tmp_path):
    dir_a, dir_b = _model_dir(tmp_path, 0), _model_dir(tmp_path, 7)

    async def main():
        engine = _engine(dir_a)
        try:
            # 1) log-probs after temperature, equal to the trainer's recompute (bf16 tolerance)
            sp = SamplingParams(temperature=0.7, max_tokens=48, ignore_eos=True, seed=5)
            res = await engine.generate(GenerateRequest("a", PROMPT, sp))
            assert res.ok and res.finish_reason == "length" and len(res.token_ids) == 48
            ref = _hf_logprobs(dir_a, PROMPT, res.token_ids, 0.7, "cuda")
            t1 = _hf_logprobs(dir_a, PROMPT, res.token_ids, 1.0, "cuda")
            got = torch.tensor(res.log_probs)
            assert (got - ref).abs().mean() < 0.03, (got - ref).abs().mean()
            assert (got - ref).abs().mean() < 0.5 * (got - t1).abs().mean()  # temperature really applied
            # 2) abort returns the partial response; continuing from it finishes with the prefix kept
            long = SamplingParams(temperature=1.0, max_tokens=480, ignore_eos=True, seed=1)
            tasks = [asyncio.create_task(engine.generate(GenerateRequest(f"l{i}", PROMPT, long))) for i in range(8)]
            await asyncio.sleep(0.3)
            await engine.abort(None)
            parts = await asyncio.gather(*tasks)
            aborted = [p for p in parts if p.finish_reason == "abort"]
            assert aborted, [p.finish_reason for p in parts]
            part = aborted[0]
            assert 0 < len(part.token_ids) < 480 and len(part.log_probs) == len(part.token_ids)
            cont = await engine.generate(GenerateRequest("c", PROMPT, long, prefix_token_ids=part.token_ids,
                                                         prefix_log_probs=part.log_probs,
                                                         prefix_versions=[0] * len(part.token_ids)))
            assert cont.finish_reason == "length" and len(cont.token_ids) == 480
            assert cont.token_ids[: len(part.token_ids)] == part.token_ids
            # 3) object-store weight update: the engine now samples model B
            from safetensors.torch import load_file

            import glob

            state = {}
            for f in glob.glob(f"{dir_b}/*.safetensors"):
                state.update(load_file(f))
            state.pop("lm_head.weight", None)
            await engine.update_weights([list(state.items())[:5], list(state.items())[5:]], 3)
            assert engine.version == 3
            res = await engine.generate(GenerateRequest("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=32,
                                                                                     ignore_eos=True)))
            assert res.versions == [3] * 32
            ref_b = _hf_logprobs(dir_b, PROMPT, res.token_ids, 1.0, "cuda")  # greedy reports T=1
            assert (torch.tensor(res.log_probs) - ref_b).abs().mean() < 0.03
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.vllm
def test_vllm_receives_an_nccl_broadcast_bit_exact(tmp_path):
    """Sender on cuda:1 (a thread of this process), vLLM's worker on cuda:0: checksums equal, weights used."""
    from safetensors.torch import load_file

    import glob

    dir_a, dir_b = _model_dir(tmp_path, 0), _model_dir(tmp_path, 7)
    state = {}
    for f in glob.glob(f"{dir_b}/*.safetensors"):
        state.update(load_file(f))
    state = {k: v.bfloat16() for k, v in state.items() if k != "lm_head.weight"}
    plan = plan_buckets([(n, t.dtype, t.shape) for n, t in state.items()], 1 << 20)
    store, port = master_store("127.0.0.1", 120)
    sent: dict = {}

    def sender():
        torch.cuda.set_device(1)
        group = WeightSyncGroup("nccl", "", 0, 0, 2, 120, store=store, name="n")
        group.handshake()
        on_gpu = ((n, t.to("cuda:1")) for n, t in state.items())
        sent.update(send_buckets(group, plan, on_gpu, verify=True))

    async def main():
        engine = _engine(dir_a)
        try:
            member = engine_side(engine)
            assert await member.ranks() == 1
            th = threading.Thread(target=sender)
            th.start()
            await member.join("127.0.0.1", port, 1, 2, "nccl", 120, "n")
            got = await member.receive(plan_to_wire(plan), version=4, verify=True)
            th.join(60)
            assert got["checksums"] == sent["checksums"] and len(got["checksums"]) == len(state)
            res = await engine.generate(GenerateRequest("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=32,
                                                                                     ignore_eos=True)))
            ref_b = _hf_logprobs(dir_b, PROMPT, res.token_ids, 1.0, "cuda:1")
            assert (torch.tensor(res.log_probs) - ref_b).abs().mean() < 0.03
            await member.leave()
        finally:
            await engine.shutdown()

    asyncio.run(main())
