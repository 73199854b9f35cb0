"""scripts/bench_engine.py on CPU: arguments, the length check, the table/rows with vLLM fields, and the --vllm
phase against a stand-in `vllm` module (the real one runs on the GPU machine; nothing here is timed)."""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

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
    assert args.vllm is False and args.vllm_mem == 0.5 and args.vllm_logprobs is True


def test_vllm_flags_parsed(be):
    args = be.parse_args(["--device", "cuda", "--vllm", "--vllm-mem", "0.3", "--no-vllm-logprobs", "--batches", "1,8"])
    assert args.vllm is True and args.vllm_mem == 0.3 and args.vllm_logprobs is False
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

def test_engine_kwargs_follow_the_native_engine(be):
    args = be.parse_args(["--device", "cuda", "--vllm", "--vllm-mem", "0.4", "--batches", "1,16,64", "--seed", "7"])
    kw = be.vllm_engine_kwargs(args, "/m", "torch.bfloat16")
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.4
    assert kw["max_num_seqs"] == 64 and kw["max_model_len"] == be.model_len(args) == 2304  # 128 + 2048 up to 256s
    assert kw["max_num_batched_tokens"] == 8192 and kw["enforce_eager"] is False and kw["seed"] == 7
    assert kw["skip_tokenizer_init"] is True and "worker_extension_cls" not in kw


@pytest.mark.parametrize("logprobs", [True, False])
def test_sampling_is_exact_length(be, logprobs):
    kws = be.vllm_sampling([3, 17], logprobs)
    assert [k["max_tokens"] for k in kws] == [3, 17]
    for k in kws:
        assert k["ignore_eos"] is True and k["temperature"] == 1.0 and k["top_p"] == 1.0 and k["top_k"] == 0
        assert k["seed"] is None and "min_tokens" not in k and k["stop_token_ids"] == []
        assert ("logprobs" in k) == logprobs and k.get("logprobs", 0) == 0


class FakeLLM:
    instances: list = []

    def __init__(self, short: int | None = None, **kwargs):
        self.kwargs, self.short, self.calls, self.shut = kwargs, short, [], False
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=self._shutdown))
        FakeLLM.instances.append(self)

    def _shutdown(self):
        self.shut = True

    def generate(self, prompts, params, use_tqdm=True):
        assert use_tqdm is False and len(prompts) == len(params)
        self.calls.append(([p["prompt_token_ids"] for p in prompts], [p.kw for p in params]))
        outs = []
        for i, p in enumerate(params):
            n = p.kw["max_tokens"] - (1 if self.short == i and len(self.calls) > 1 else 0)
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[0] * n)]))
        return outs


def fake_vllm(monkeypatch, short=None):
    FakeLLM.instances = []
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.0-fake"
    vllm.LLM = lambda **kw: FakeLLM(short=short, **kw)
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(kw=kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: dict(kw)
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})


def workloads(be, args, vocab=50):
    import torch

    rng = torch.Generator().manual_seed(args.seed)
    return [(b, *be.workload(args, b, vocab, rng)) for b in args.batch_list]


def test_run_vllm_same_workload_one_engine(be, monkeypatch):
    fake_vllm(monkeypatch)
    args = be.parse_args(["--device", "cuda", "--vllm", "--batches", "2,5", "--prompt-len", "6", "--max-len", "40"])
    wls = workloads(be, args)
    info, rows = be.run_vllm(args, "/m", "torch.bfloat16", 50, wls)
    assert len(FakeLLM.instances) == 1  # built once for every batch size
    llm = FakeLLM.instances[0]
    assert llm.kwargs["max_num_seqs"] == 5 and llm.kwargs["gpu_memory_utilization"] == 0.5 and llm.shut
    warm_prompts, warm_params = llm.calls[0]
    assert len(warm_prompts) == 5 and all(p["max_tokens"] == be.VLLM_WARMUP_TOKENS for p in warm_params)
    assert not {tuple(p) for p in warm_prompts} & {tuple(p) for w in wls for p in w[1]}  # no prefix-cache hits
    for (batch, prompts, lengths), (sent, params), r in zip(wls, llm.calls[1:], rows):
        assert sent == prompts and [p["max_tokens"] for p in params] == lengths
        assert r["batch"] == batch and r["vllm_tok_s"] == pytest.approx(sum(lengths) / r["vllm_s"])
    assert info["version"] == "0.0-fake" and info["logprobs"] is True
    assert info["env"] == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def test_run_vllm_rejects_short_responses_and_still_releases(be, monkeypatch):
    fake_vllm(monkeypatch, short=1)
    args = be.parse_args(["--device", "cuda", "--vllm", "--batches", "3", "--prompt-len", "4"])
    with pytest.raises(RuntimeError, match="vLLM did not produce the target lengths: 1 of 3"):
        be.run_vllm(args, "/m", "torch.bfloat16", 50, workloads(be, args))
    assert FakeLLM.instances[0].shut


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
