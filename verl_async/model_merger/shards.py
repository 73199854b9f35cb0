"""A checkpoint's model shards as one {HF name: full tensor} dict, in one process (no process group).

FSDP2: `actor/dcp/` is a torch.distributed.checkpoint of {"model": ..., "optimizer": ...}; only the
model entries are read (their global shapes are in the DCP metadata), into full tensors.

Megatron: `actor/megatron/model_tp{t}_pp{p}.pt` holds the state dict of pipeline stage p's TP shard t
(local layer numbers); `names_pp{p}.json` maps them to global names (checkpoints without it: an even
split of the layers, megatron-core's default). Each global parameter's TP shards are joined back
into HF tensors by trainer/megatron/convert.py, the code that split them at load.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Mapping

import torch


class ShardError(RuntimeError):
    """The shards are missing or do not add up to the model; the message names the file or tensor."""


def fsdp_state(local_dir: str) -> dict[str, torch.Tensor]:
    """Full model tensors of an FSDP2 checkpoint, by their HF names (`model.` prefix of the DCP keys removed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = os.path.join(local_dir, "dcp")
    if not os.path.isdir(folder):
        raise ShardError(f"{local_dir!r} has no dcp/ folder of FSDP shards (a Megatron checkpoint has megatron/: "
                         f"--backend megatron)")
    reader = FileSystemReader(folder)
    entries = reader.read_metadata().state_dict_metadata
    state = {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in entries.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise ShardError(f"{folder!r} holds no model tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def megatron_state(local_dir: str, meta: Mapping[str, Any], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF tensors of a Megatron checkpoint: TP shards joined, pipeline stages renamed to global layers."""
    from verl_async.trainer.megatron.convert import (
        ConversionError,
        from_mcore_shards,
        hf_names,
        model_spec,
        param_map_for,
    )

    layout = dict(meta.get("layout") or {})
    tp, pp = int(layout.get("tensor_model_parallel_size", 1)), int(layout.get("pipeline_model_parallel_size", 1))
    folder = os.path.join(local_dir, "megatron")
    spec = model_spec(hf_config)
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [_load(os.path.join(folder, f"model_tp{t}_pp{stage}.pt")) for t in range(tp)]
        names = _stage_names(folder, stage, spec.num_layers // pp, shards[0])
        for local, glob in names.items():
            if glob == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the last stage's copy of the embedding
            try:
                pm = param_map_for(spec, glob)
                tensors = from_mcore_shards(spec, pm, [s[local] for s in shards])
            except (ConversionError, KeyError) as exc:
                raise ShardError(f"{folder}: stage {stage} parameter {local!r} ({glob}): {exc}") from exc
            out.update(zip(pm.hf, tensors))
    missing = [n for n in hf_names(spec) if n not in out]
    if missing:
        raise ShardError(f"{folder}: the shards hold no {missing[:4]} (layout tp={tp}, pp={pp} from meta.json)")
    return out


def _load(path: str) -> dict[str, torch.Tensor]:
    if not os.path.exists(path):
        raise ShardError(f"missing Megatron model shard {path!r} (meta.json's layout names it)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}  # no _extra_state entries


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _stage_names(folder: str, stage: int, layers_per_stage: int, shard: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Local parameter name -> global Megatron name for one pipeline stage."""
    path = os.path.join(folder, f"names_pp{stage}.json")
    if os.path.exists(path):
        with open(path) as f:
            return dict(json.load(f))
    offset = stage * layers_per_stage  # written before names_pp*.json existed: megatron-core's even split
    return {name: _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
            for name in shard if not name.endswith("._extra_state")}
