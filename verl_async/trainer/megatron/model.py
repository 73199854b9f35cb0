"""Megatron-core GPT models from HF checkpoints, and HF-named tensors back out.

Needs megatron-core and an initialised `parallel_state`. One rank builds only its
pipeline stage (`pre_process` / `post_process`) and fills its TP shards straight
from the HF safetensors (`convert.HFCheckpoint`): no offline conversion step and no
full model in any rank's memory.

`iter_hf_weights` is collective over the model-parallel ranks of data-parallel
replica 0: each stage gathers its TP shards (all-gather in the TP group), its TP
rank 0 converts them to HF tensors and sends them to global rank 0, which yields
them in HF order. Other replicas return at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from verl_async.trainer.megatron.convert import (
    ConversionError,
    HFCheckpoint,
    ModelSpec,
    expected_hf_shapes,
    from_mcore_shards,
    gpt_model_kwargs,
    param_map_for,
    to_mcore_shard,
    transformer_config_kwargs,
    unexpected_hf_tensors,
)
from verl_async.trainer.megatron.settings import MegatronSettings

_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def transformer_config(spec: ModelSpec, ms: MegatronSettings, overrides: dict[str, Any], *, dtype: torch.dtype,
                       device: str, sequence_parallel: bool):
    """megatron-core TransformerConfig: architecture from HF, layout from the megatron keys, then overrides."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(transformer_config_kwargs(spec))
    kwargs.update(
        tensor_model_parallel_size=ms.tp, pipeline_model_parallel_size=ms.pp, context_parallel_size=ms.cp,
        sequence_parallel=sequence_parallel, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # perform_initialization stays on although HF weights overwrite the values: with it off megatron-core
        # skips tagging TP-sharded weights (`tensor_model_parallel`), and the grad norm then drops them.
        use_cpu_initialization=device == "cpu", perform_initialization=True,
        # Micro-batches differ in shape (dynamic batch size): pipeline stages exchange shapes first.
        variable_seq_lengths=ms.pp > 1,
    )
    if ms.pp > 1:
        kwargs["moe_token_dispatcher_type"] = "alltoall"  # megatron refuses variable lengths with the default
    if ms.recompute:  # model.enable_gradient_checkpointing, as verl maps it
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    try:
        return TransformerConfig(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"megatron-core refused the TransformerConfig built from the HF config and "
                         f"actor_rollout_ref.actor.megatron.* ({type(exc).__name__}: {exc})") from exc


def transformer_config_fields() -> set[str]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


def optimizer_config_fields() -> set[str]:
    from megatron.core.optimizer import OptimizerConfig

    return {f.name for f in dataclasses.fields(OptimizerConfig)}


def build_gpt(spec: ModelSpec, config: Any, tp: int):
    """This rank's pipeline stage of the GPT model (logits gathered over TP: full vocabulary)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=layer_spec, pre_process=mpu.is_pipeline_first_stage(),
                    post_process=mpu.is_pipeline_last_stage(), parallel_output=False, **gpt_model_kwargs(spec, tp))


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> global Megatron name (layer indices counted over all pipeline stages)."""
    renames: dict[str, str] = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for local, layer in enumerate(decoder.layers):
            renames[f"decoder.layers.{local}."] = f"decoder.layers.{layer.layer_number - 1}."
    out = {}
    for name, _ in model.named_parameters():
        glob = name
        for prefix, target in renames.items():
            if name.startswith(prefix):
                glob = target + name[len(prefix):]
                break
        out[name] = glob
    return out


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, spec: ModelSpec, path: str, tp_rank: int, tp_size: int) -> int:
    """Fill this rank's shards from the HF folder; every parameter must be covered. Returns tensors read."""
    ckpt = HFCheckpoint(path)
    try:
        extra = unexpected_hf_tensors(spec, ckpt.names())
        if extra:
            raise ConversionError(f"HF checkpoint {path!r} holds tensors the Megatron layout has no place for "
                                  f"({spec.arch}): {extra[:6]}")
        names = global_names(model)
        read = 0
        for local, param in model.named_parameters():
            pm = param_map_for(spec, names[local])
            shard = to_mcore_shard(spec, pm, [ckpt.get(n) for n in pm.hf], tp_rank, tp_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConversionError(f"{names[local]}: converted shard {tuple(shard.shape)} does not fit the "
                                      f"Megatron parameter {tuple(param.shape)} (TP rank {tp_rank}/{tp_size})")
            param.data.copy_(shard.to(dtype=param.dtype))
            read += len(pm.hf)
        return read
    finally:
        ckpt.close()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every global rank sits: (dp, tp, pp) per rank, gathered once at init."""

    coords: tuple[tuple[int, int, int], ...]

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        return self.coords.index((dp, tp, pp))


def gather_layout(dp: int, tp: int, pp: int, world_size: int) -> Layout:
    coords: list[Any] = [None] * world_size
    dist.all_gather_object(coords, (dp, tp, pp))
    return Layout(tuple(tuple(c) for c in coords))


def _sent_params(model: torch.nn.Module, spec: ModelSpec) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's (global name, parameter) in the order `iter_hf_weights` sends them (a tied model's output layer
    is not sent)."""
    names = global_names(model)
    return [(names[n], p) for n, p in model.named_parameters()
            if not (spec.tie_word_embeddings and names[n] == "output_layer.weight")]


def hf_param_shapes(model: torch.nn.Module, spec: ModelSpec, layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, full shape) in `iter_hf_weights`' order, from metadata alone: every stage's names are gathered
    once (collective over the world: every rank calls it, at start-up), so rank 0 can plan a collective weight
    sync's buckets before any weight is gathered."""
    listings: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(listings, [g for g, _ in _sent_params(model, spec)])
    out: list[tuple[str, tuple[int, ...]]] = []
    for stage in range(1 + max(c[2] for c in layout.coords)):
        for glob in listings[layout.rank_of(0, 0, stage)]:
            pm = param_map_for(spec, glob)
            out.extend(zip(pm.hf, (tuple(shape) for shape in expected_hf_shapes(spec, pm))))
    return out


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, spec: ModelSpec, layout: Layout, *, rank: int, dtype: torch.dtype,
                    comm_device: torch.device, to_cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on global rank 0, on the host unless `to_cpu=False` (a collective weight sync sends
    device tensors); collective over replica 0 (see the module docstring).

    Tied models: the last stage's copy of the embedding (`output_layer.weight`) is not sent.
    """
    from megatron.core import parallel_state as mpu

    dp, tp, pp = layout.coords[rank]
    if dp != 0:
        return
    tp_size = mpu.get_tensor_model_parallel_world_size()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    tp_group = mpu.get_tensor_model_parallel_group()
    mp_group = mpu.get_model_parallel_group()
    mine = _sent_params(model, spec)
    for stage in range(pp_size):
        src = layout.rank_of(0, 0, stage)
        if pp_size > 1:  # the other stages' ranks learn what this stage will send
            listing = [[g for g, _ in mine] if rank == src else None]
            dist.broadcast_object_list(listing, src=src, group=mp_group)
        else:
            listing = [[g for g, _ in mine]]
        for i, glob in enumerate(listing[0]):
            pm = param_map_for(spec, glob)
            hf: Optional[list[torch.Tensor]] = None
            if pp == stage:
                local = mine[i][1].detach().to(device=comm_device, dtype=dtype).contiguous()
                if tp_size > 1:
                    shards = [torch.empty_like(local) for _ in range(tp_size)]
                    dist.all_gather(shards, local, group=tp_group)
                else:
                    shards = [local]
                if tp == 0:
                    hf = from_mcore_shards(spec, pm, shards)
                    if rank != 0:
                        for t in hf:
                            dist.send(t.contiguous(), dst=0)
            elif rank == 0:
                hf = [torch.empty(shape, dtype=dtype, device=comm_device) for shape in expected_hf_shapes(spec, pm)]
                for t in hf:
                    dist.recv(t, src=src)
            if rank == 0:
                for name, t in zip(pm.hf, hf):
                    # always a copy: a replicated tensor would otherwise alias the live (offloadable) parameter
                    yield name, t.detach().to("cpu" if to_cpu else t.device, copy=True)
