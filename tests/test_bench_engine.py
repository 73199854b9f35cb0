"""scripts/bench_engine.py on CPU: arguments, the length check, the table/rows with vLLM fields, and the --vllm
phase: the rollout's VLLMEngine over a stand-in vLLM AsyncLLM (the real one runs on the GPU machine; nothing here
is timed)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import types

import pytest

from tests.fakes import install_fake_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def be():
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", os.path.join(ROOT, "scripts", "bench_engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(be, batch=4, lengths=(3, 5, 8, 2), wall=0.5):
    prof = {"decode_steps": 8, "weight_bytes": 1000, "decode_kv_tokens": 40, "kv_bytes_per_token": 10,
            "decode_rows": 18, "decode_s": 0.4, "prefill_s": 0.05}
    return be.summarize(batch, list(lengths), wall, prof, bandwidth=1e6)


# ------------------------------------------------------------------ arguments

def test_vllm_flags_default_off(be):
    args = be.parse_args(["--device", "cpu"])
    assert args.vllm is False and args.vllm_mem == 0.5


def test_vllm_flags_parsed(be):
    args = be.parse_args(["--device", "cuda", "--vllm", "--vllm-mem", "0.3", "--batches", "1,8"])
    assert args.vllm is True and args.vllm_mem == 0.3
    assert args.batch_list == [1, 8]


@pytest.mark.parametrize("argv", [["--device", "cpu", "--vllm"], ["--device", "cuda", "--vllm", "--vllm-mem", "0"],
                                  ["--device", "cuda", "--vllm", "--vllm-mem", "1.5"]])
def test_vllm_flag_errors(be, argv, capsys):
    with pytest.raises(SystemExit):
        be.parse_args(argv)
    assert "--vllm" in capsys.readouterr().err


def test_missing_vllm_fails_at_once_naming_the_flag(be, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit, match="--vllm needs vLLM"):
        be.main(["--device", "cuda", "--vllm"])  # before any device or model work


# ------------------------------------------------------------------ length check

def test_check_lengths_returns_useful_tokens(be):
    assert be.check_lengths([3, 5, 8], [3, 5, 8], "vLLM") == 16


def test_check_lengths_names_the_mismatches(be):
    with pytest.raises(RuntimeError, match=r"vLLM did not produce the target lengths: 2 of 4 .*#1: 4/5, #3: 9/2"):
        be.check_lengths([3, 4, 8, 9], [3, 5, 8, 2], "vLLM")


def test_check_lengths_counts_responses(be):
    with pytest.raises(RuntimeError, match="3 responses for 4 requests"):
        be.check_lengths([3, 5, 8], [3, 5, 8, 2], "vLLM")


# ------------------------------------------------------------------ rows and table

def test_merge_vllm_adds_fields_and_ratio(be):
    rows = [row(be, batch=1, lengths=(4,), wall=0.2), row(be, batch=4, wall=0.5)]
    be.merge_vllm(rows, [{"batch": 4, "vllm_s": 1.0, "vllm_tok_s": 18.0}])
    assert "vllm_s" not in rows[0]
    assert rows[1]["vllm_s"] == 1.0 and rows[1]["vllm_tok_s"] == 18.0
    assert rows[1]["native_vs_vllm"] == pytest.approx(2.0)  # vLLM took twice the native engine's time


def test_table_row_with_and_without_vllm(be):
    plain = row(be)
    with_vllm = dict(plain, vllm_s=1.0, vllm_tok_s=18.0, native_vs_vllm=2.0)
    assert "vLLM tok/s" in be.HEADER and "x vLLM" in be.HEADER
    for r in (plain, with_vllm):
        assert len(be.format_row(r)) == len(be.HEADER)  # columns stay aligned
        assert len(be.format_row(r).split()) == len(be.format_row(with_vllm).split())
    cells = be.format_row(with_vllm).split()
    assert cells[6:8] == ["18.0", "2.00"]  # vLLM tok/s, x vLLM after engine and HF columns
    assert be.format_row(plain).split()[6:8] == ["-", "-"]


# ------------------------------------------------------------------ the vLLM phase (stand-in vllm)

def test_vllm_engine_is_the_rollouts_sized_like_the_native_engine(be):
    from verl_async.rollout.vllm_engine import WORKER_EXTENSION, VLLMEngine

    args = be.parse_args(["--device", "cuda", "--vllm", "--vllm-mem", "0.4", "--batches", "1,16,64", "--seed", "7"])
    engine = be.build_vllm_engine(args, "/m", "torch.bfloat16")  # builds no vLLM yet (that is start())
    assert type(engine) is VLLMEngine and engine.llm is None
    kw = engine.engine_kwargs
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.4
    assert kw["max_num_seqs"] == 64 and kw["max_model_len"] == be.model_len(args) == 2304  # 128 + 2048 up to 256s
    assert kw["max_num_batched_tokens"] == 8192 and kw["enforce_eager"] is False and kw["seed"] == 7
    # the product's own settings, untouched
    assert kw["skip_tokenizer_init"] is True and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["worker_extension_cls"] == WORKER_EXTENSION and kw["enable_prefix_caching"] is True


class FakeAsyncLLM:
    """vLLM's AsyncLLM as far as VLLMEngine uses it for generation; records every request and the peak in flight."""

    instances: list = []
    short: str | None = None  # this request id gets one token less

    def __init__(self, engine_args):
        self.kwargs = engine_args.kwargs
        self.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=self.kwargs["max_model_len"]))
        self.requests, self.in_flight, self.peaks, self.shut = [], 0, [], False
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(engine_args)

    async def generate(self, prompt, sp, request_id):
        assert not self.shut
        self.requests.append((request_id, list(prompt["prompt_token_ids"]), dict(sp.kw), sp.output_kind.name))
        self.in_flight += 1
        self.peaks.append(self.in_flight)
        await asyncio.sleep(0)  # the other requests of the batch come in meanwhile
        n = sp.kw["max_tokens"] - (request_id == FakeAsyncLLM.short)
        out = [7] * n
        logprobs = None
        if "logprobs" in sp.kw:
            logprobs = types.SimpleNamespace(start_indices=list(range(n)), end_indices=list(range(1, n + 1)),
                                             token_ids=list(out), logprobs=[-0.5] * n)
        self.in_flight -= 1
        yield types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=out, logprobs=logprobs,
                                                                   finish_reason="length")])

    def shutdown(self):
        self.shut = True


def fake_vllm(monkeypatch, short=None, async_llm=True):
    """Just the modules VLLMEngine imports (vLLM 0.26 paths); no `vllm.LLM`: the offline entrypoint is not used."""
    FakeAsyncLLM.instances, FakeAsyncLLM.short = [], short

    install_fake_vllm(monkeypatch, FakeAsyncLLM if async_llm else None)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})


def workloads(be, args, vocab=50):
    import torch

    rng = torch.Generator().manual_seed(args.seed)
    return [(b, *be.workload(args, b, vocab, rng)) for b in args.batch_list]


def by_tag(llm, tag):
    """(prompt, SamplingParams keywords) of the requests `tag`-0, `tag`-1, ... in request order."""
    got = {rid: (prompt, kw) for rid, prompt, kw, _ in llm.requests if rid.rsplit("-", 1)[0] == tag}
    return [got[f"{tag}-{i}"] for i in range(len(got))]


def test_run_vllm_same_workload_one_engine(be, monkeypatch):
    fake_vllm(monkeypatch)
    args = be.parse_args(["--device", "cuda", "--vllm", "--batches", "2,5", "--prompt-len", "6", "--max-len", "40"])
    wls = workloads(be, args)
    info, rows = asyncio.run(be.run_vllm(args, "/m", "torch.bfloat16", 50, wls))
    assert len(FakeAsyncLLM.instances) == 1  # built once for every batch size
    llm = FakeAsyncLLM.instances[0]
    assert llm.kwargs["max_num_seqs"] == 5 and llm.kwargs["gpu_memory_utilization"] == 0.5 and llm.shut
    assert len(llm.requests) == (2 + 5) + 2 + 5 and all(kind == "FINAL_ONLY" for *_, kind in llm.requests)
    warm = by_tag(llm, "vllm-warm2") + by_tag(llm, "vllm-warm5")  # every batch size warmed (Triton: size 1 apart)
    assert len(warm) == 2 + 5 and all(kw["max_tokens"] == be.VLLM_WARMUP_TOKENS for _, kw in warm)
    assert all(rid.startswith("vllm-warm") for rid, *_ in llm.requests[:7])  # the warm-ups come first
    assert not {tuple(p) for p, _ in warm} & {tuple(p) for w in wls for p in w[1]}  # no prefix-cache hits
    assert max(llm.peaks[:7]) == 5  # submitted at once
    for (batch, prompts, lengths), r in zip(wls, rows):
        sent = by_tag(llm, f"vllm-b{batch}")
        assert [p for p, _ in sent] == prompts and [kw["max_tokens"] for _, kw in sent] == lengths
        for _, kw in sent:
            assert kw["ignore_eos"] is True and kw["temperature"] == 1.0 and kw["top_p"] == 1.0 and kw["top_k"] == 0
            assert kw["seed"] is None and "min_tokens" not in kw and kw["stop_token_ids"] == []
            assert kw["logprobs"] == 0  # the sampled token's log-prob, as our rollouts ask
        assert r["batch"] == batch and r["vllm_tok_s"] == pytest.approx(sum(lengths) / r["vllm_s"])
    assert max(llm.peaks[7:9]) == 2 and max(llm.peaks[9:]) == 5  # each batch submitted at once
    assert info["engine"] == "verl_async.rollout.vllm_engine.VLLMEngine" and info["version"] == "0.0-fake"
    assert info["engine_kwargs"]["max_num_seqs"] == 5
    assert info["env"] == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def test_run_vllm_rejects_short_responses_and_still_shuts_down(be, monkeypatch):
    fake_vllm(monkeypatch, short="vllm-b3-1")
    args = be.parse_args(["--device", "cuda", "--vllm", "--batches", "3", "--prompt-len", "4"])
    with pytest.raises(RuntimeError, match="vLLM did not produce the target lengths: 1 of 3"):
        asyncio.run(be.run_vllm(args, "/m", "torch.bfloat16", 50, workloads(be, args)))
    assert FakeAsyncLLM.instances[0].shut


def test_run_vllm_without_async_llm_names_the_flag(be, monkeypatch):
    fake_vllm(monkeypatch, async_llm=False)
    args = be.parse_args(["--device", "cuda", "--vllm", "--batches", "3", "--prompt-len", "4"])
    with pytest.raises(SystemExit, match="--vllm could not start vLLM"):
        asyncio.run(be.run_vllm(args, "/m", "torch.bfloat16", 50, workloads(be, args)))
    assert FakeAsyncLLM.instances == []


def test_model_dir_for_vllm(be, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    args = be.parse_args(["--device", "cuda", "--model", str(tmp_path)])
    assert be.vllm_model_dir(args, None) == str(tmp_path)
    assert be.vllm_model_dir(be.parse_args(["--device", "cpu"]), None) == be.TINY_DIR
    monkeypatch.setattr(be.tempfile, "tempdir", str(tmp_path))
    cfg = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, vocab_size=40, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = be.vllm_model_dir(be.parse_args(["--device", "cuda"]), model)  # the random-weight default on cuda
    assert path.startswith(str(tmp_path)) and os.path.exists(os.path.join(path, "config.json"))
    back = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert torch.equal(back.model.embed_tokens.weight, model.model.embed_tokens.weight)


# ------------------------------------------------------------------ vLLM's own LLM.generate (--vllm-offline)

class FakeLLM:
    """vllm.LLM as far as --vllm-offline uses it: records its keywords and every generate call."""

    instances: list = []
    short_index: int | None = None  # this request of every timed batch gets one token less

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.shut = kwargs, [], False
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=self._shutdown))
        FakeLLM.instances.append(self)

    def _shutdown(self):
        self.shut = True

    def generate(self, prompts, params, use_tqdm=True):
        assert not self.shut and use_tqdm is False and len(prompts) == len(params)
        self.calls.append(([p["prompt_token_ids"] for p in prompts], [sp.kw for sp in params]))
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
            token_ids=[7] * (sp.kw["max_tokens"] - (i == FakeLLM.short_index and len(self.calls) > 1)))])
            for i, sp in enumerate(params)]


def fake_offline_vllm(monkeypatch, short_index=None):
    FakeLLM.instances, FakeLLM.short_index = [], short_index
    mods = install_fake_vllm(monkeypatch, None)
    mods["vllm"].LLM = FakeLLM
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})


def test_vllm_offline_flags(be, capsys):
    args = be.parse_args(["--device", "cuda", "--vllm-offline"])
    assert args.vllm_offline is True and args.vllm is False and args.vllm_offline_logprobs is True
    assert be.parse_args(["--device", "cuda", "--vllm-offline", "--vllm-offline-no-logprobs"]).vllm_offline_logprobs is False
    with pytest.raises(SystemExit):
        be.parse_args(["--device", "cpu", "--vllm-offline"])
    assert "--vllm-offline runs vLLM on the GPU" in capsys.readouterr().err


def test_the_length_plan_forces_each_response_to_its_target(be):
    kws = be.offline_sampling_kwargs([3, 250, 17])
    assert [kw["max_tokens"] for kw in kws] == [3, 250, 17]
    assert all(kw["ignore_eos"] is True and kw["temperature"] == 1.0 and kw["top_p"] == 1.0 and kw["top_k"] == 0
               and kw["logprobs"] == 0 and kw["detokenize"] is False and kw["stop_token_ids"] == [] for kw in kws)
    assert "logprobs" not in be.offline_sampling_kwargs([3], logprobs=False)[0]


def test_offline_llm_is_sized_like_the_adapter(be):
    args = be.parse_args(["--device", "cuda", "--vllm-offline", "--vllm-mem", "0.4", "--batches", "1,16,64", "--seed", "7"])
    kw = be.offline_llm_kwargs(args, "/m", "torch.bfloat16")
    sizes = be.vllm_rollout_config(args, "torch.bfloat16")
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.4
    assert {k: kw[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")} == \
        {k: sizes[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")}
    assert kw["enforce_eager"] is False and kw["seed"] == 7 and kw["skip_tokenizer_init"] is True


def test_run_vllm_offline_same_workload_one_llm(be, monkeypatch):
    fake_offline_vllm(monkeypatch)
    args = be.parse_args(["--device", "cuda", "--vllm-offline", "--batches", "2,5", "--prompt-len", "6", "--max-len", "40"])
    wls = workloads(be, args)
    info, rows = be.run_vllm_offline(args, "/m", "torch.bfloat16", 50, wls)
    [llm] = FakeLLM.instances
    assert llm.shut and llm.kwargs["max_num_seqs"] == 5 and len(llm.calls) == 4  # a warm-up per batch size, then each
    assert [len(prompts) for prompts, _ in llm.calls[:2]] == [2, 5]
    warm_prompts = [p for prompts, _ in llm.calls[:2] for p in prompts]
    assert all(kw["max_tokens"] == be.VLLM_WARMUP_TOKENS for _, kws in llm.calls[:2] for kw in kws)
    assert not {tuple(p) for p in warm_prompts} & {tuple(p) for w in wls for p in w[1]}  # no prefix-cache hits
    for (batch, prompts, lengths), (sent, kws), r in zip(wls, llm.calls[2:], rows):
        assert sent == prompts and [kw["max_tokens"] for kw in kws] == lengths
        assert r["batch"] == batch and r["vllm_offline_tok_s"] == pytest.approx(sum(lengths) / r["vllm_offline_s"])
    assert info["entry"] == "vllm.LLM.generate" and info["logprobs"] is True
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    native = [row(be, batch=2, lengths=wls[0][2], wall=0.1), row(be, batch=5, lengths=wls[1][2], wall=0.2)]
    be.merge_vllm(native, rows, key="vllm_offline")
    assert native[1]["native_vs_vllm_offline"] == pytest.approx(rows[1]["vllm_offline_s"] / 0.2)
    assert len(be.format_row(native[1])) == len(be.HEADER) and be.format_row(native[1]).split()[-2:] == [
        f"{rows[1]['vllm_offline_tok_s']:.1f}", f"{native[1]['native_vs_vllm_offline']:.2f}"]


def test_run_vllm_offline_rejects_short_responses_and_still_shuts_down(be, monkeypatch):
    fake_offline_vllm(monkeypatch, short_index=1)
    args = be.parse_args(["--device", "cuda", "--vllm-offline", "--batches", "3", "--prompt-len", "4"])
    with pytest.raises(RuntimeError, match="vLLM LLM.generate did not produce the target lengths: 1 of 3"):
        be.run_vllm_offline(args, "/m", "torch.bfloat16", 50, workloads(be, args))
    assert FakeLLM.instances[0].shut
