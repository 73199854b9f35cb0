"""Leave with the model: a trainer checkpoint as a plain HF folder, offline (verl's `model_merger`).

    python -m verl_async.model_merger merge --backend fsdp --local_dir <ckpt>/actor --target_dir <dir>

`<ckpt>/actor` is a checkpoint folder (`global_step_N/actor`, verl_async/checkpoint.py). The merger
reads its shards in one process, without Ray, a GPU or megatron-core: DCP shards of the FSDP2
trainer (shards.fsdp_state), per-rank files of the Megatron trainer converted back to HF names
(shards.megatron_state, trainer/megatron/convert.py). It writes config, tokenizer (chat template
included), generation config and safetensors in the training dtype, which
`AutoModelForCausalLM.from_pretrained` loads with the trainer's logits at that step.
"""

from verl_async.model_merger.merge import MergeError, merge

__all__ = ["MergeError", "merge"]
