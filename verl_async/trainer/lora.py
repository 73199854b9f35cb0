"""LoRA for the FSDP2 trainer, through peft (verl's keys: `actor_rollout_ref.model.lora_rank`, `lora_alpha`,
`target_modules`, `exclude_modules`, `lora_adapter_path`).

The policy is the base model with low-rank adapters on the targeted linear layers (`W + alpha/r B A`);
only the adapters train (the optimizer holds their state alone) and the reference policy is the same
model with its adapters switched off (no second copy of the weights). peft wraps the layers before
FSDP2 shards the model, so checkpoints hold the base weights and the adapters under peft's names.

What leaves the trainer is merged: the weight sync and the HF export send `W + alpha/r B A` under
the base model's HF names (`merged_weights`), so an engine loads them as a full fine-tune's weights.
Why merged and not the adapters: both engines (native and vLLM) then serve the plain model with no
adapter kernels in generation (vLLM's `enable_lora` runs extra GEMMs per token and bounds the rank
and batch), every transport (object store, NCCL, CUDA IPC) and the engine's check that every
parameter was written work unchanged, and the tokens are sampled by exactly the weights the trainer
merged. The price: a sync moves the whole model, as with full fine-tuning (verl's `lora.merge=True`);
LoRA's saving is in the trainer (optimizer state, gradients, no reference copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Union

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: Any  # "all-linear" or a list of module names (peft's)
    exclude_modules: Any
    adapter_path: Optional[str] = None  # continue from a saved peft adapter

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def apply_lora(model: torch.nn.Module, lora: LoraSettings) -> torch.nn.Module:
    """The peft model around `model`: new adapters, or the ones at `adapter_path` (trainable)."""
    from verl_async.optional import PEFT, require

    peft = require(PEFT)
    if lora.adapter_path:
        return peft.PeftModel.from_pretrained(model, lora.adapter_path, is_trainable=True)
    targets = lora.target_modules
    targets = list(targets) if isinstance(targets, (list, tuple)) else targets
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,
                             exclude_modules=lora.exclude_modules, bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """HF module name -> alpha / r of every adapted layer (peft's own numbers)."""
    out = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling and hasattr(module, "base_layer"):
            out[hf_module_name(name)] = float(scaling[ADAPTER])
    return out


def hf_module_name(peft_name: str) -> str:
    """peft's name of a module or parameter -> the base model's (HF) name."""
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".base_layer", "")


def _split(peft_name: str) -> tuple[str, Optional[str]]:
    """(HF module name, 'A' | 'B') for an adapter parameter, (HF parameter name, None) otherwise."""
    for part, which in ((f".lora_A.{ADAPTER}.weight", "A"), (f".lora_B.{ADAPTER}.weight", "B")):
        if peft_name.endswith(part):
            return hf_module_name(peft_name[: -len(part)]), which
    if ".lora_" in peft_name:
        raise ValueError(f"{peft_name}: only LoRA adapters on linear layers can be merged (not embeddings, DoRA or "
                         "other adapters)")
    return hf_module_name(peft_name), None


def _merge_order(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any, Optional[dict]]]:
    """(HF name, item, None) for a parameter that passes as it is, (HF name, None, {"W", "A", "B"}) for an adapted
    layer's weight once its base weight and both adapters have come (at the position of the last of them)."""
    pending: dict[str, dict[str, Any]] = {}
    held: dict[str, list] = {}  # an adapted layer's bias, after its weight as in the base model's order
    for name, item in named:
        hf, which = _split(name)
        if which is None and ".base_layer." not in name:
            yield hf, item, None  # not adapted
            continue
        module = hf if which else hf.rsplit(".", 1)[0]
        if which is None and not hf.endswith(".weight"):
            held.setdefault(module, []).append((hf, item))
            continue
        parts = pending.setdefault(module, {})
        parts[which or "W"] = item
        if len(parts) == 3:
            yield f"{module}.weight", None, pending.pop(module)
            for bias, value in held.pop(module, []):
                yield bias, value, None
    if pending or held:
        raise ValueError(f"LoRA layers without their base weight or both adapters: {sorted({*pending, *held})[:4]}")


def merged_weights(named: Iterable[tuple[str, torch.Tensor]], scaling: Union[float, Mapping[str, float]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full tensor) in `named_parameters` order -> (HF name, weight) with every adapted layer merged:
    W + scaling * B @ A (in float32, back in W's dtype). Unadapted parameters pass under their HF names.

    `scaling`: one number (alpha / r) or one per HF module name (`lora_scalings`)."""
    for hf, tensor, parts in _merge_order(named):
        if parts is None:
            yield hf, tensor
            continue
        module = hf[: -len(".weight")]
        scale = scaling if isinstance(scaling, (int, float)) else scaling[module]
        w = parts["W"]
        delta = (parts["B"].float() @ parts["A"].float()) * scale
        yield hf, (w.float() + delta.to(w.device)).to(w.dtype)


def merged_state(state: Mapping[str, torch.Tensor], scaling: Union[float, Mapping[str, float]]) -> dict:
    """`merged_weights` of a whole state dict (the model merger's; DCP keys are peft's parameter names)."""
    return dict(merged_weights(state.items(), scaling))


def merged_shapes(named: Iterable[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of what `merged_weights` yields, in its order, from (peft name, shape) alone (no gather)."""
    return [(hf, shape if parts is None else parts["W"]) for hf, shape, parts in _merge_order(named)]
