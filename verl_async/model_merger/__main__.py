"""`python -m verl_async.model_merger merge --backend fsdp|megatron --local_dir <ckpt>/actor --target_dir <dir>`.

verl's command line: the same subcommand and flags. `--dtype` (new) chooses the dtype of the
safetensors; by default the one the trainer computed in (meta.json `hf_dtype`). verl flags that
have nothing to do here are accepted and say so; those that would change the result are refused.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from verl_async.model_merger.merge import BACKENDS, MergeError, merge
from verl_async.trainer.common import DTYPES


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m verl_async.model_merger",
                                  description="Write a trainer checkpoint as an HF model folder (offline, CPU).")
    sub = top.add_subparsers(dest="command", required=True)
    merge_cmd = sub.add_parser("merge", help="checkpoint folder -> HF folder (config, tokenizer, safetensors)")
    merge_cmd.add_argument("--backend", required=True, choices=BACKENDS, help="the trainer that wrote the checkpoint")
    merge_cmd.add_argument("--local_dir", required=True, help="the checkpoint's actor folder: .../global_step_N/actor")
    merge_cmd.add_argument("--target_dir", required=True, help="where the HF folder goes (created)")
    merge_cmd.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                           help="dtype of the safetensors (default: the training dtype recorded in the checkpoint)")
    merge_cmd.add_argument("--hf_model_path", default=None,
                           help="config/tokenizer source for checkpoints without actor/huggingface (older ones)")
    merge_cmd.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true")
    # verl's flags: accepted where they change nothing here
    merge_cmd.add_argument("--tie-word-embedding", dest="tie_word_embedding", action="store_true",
                           help="verl's flag; ignored: the checkpoint's config says whether embeddings are tied")
    merge_cmd.add_argument("--use_cpu_initialization", action="store_true", help="verl's flag; the merger is CPU-only")
    merge_cmd.add_argument("--is-value-model", dest="is_value_model", action="store_true",
                           help="verl's flag; refused: verl_async trains no critic")
    merge_cmd.add_argument("--hf_upload_path", default=None, help="verl's flag; refused: upload the target folder "
                                                                   "with `huggingface-cli upload`")
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.is_value_model:
            raise MergeError("--is-value-model: verl_async trains no critic (value model); only the actor is merged")
        if args.hf_upload_path:
            raise MergeError("--hf_upload_path: the merger does not upload; run `huggingface-cli upload <repo> "
                             f"{args.target_dir}` after it")
        if args.tie_word_embedding:
            print("note: --tie-word-embedding is not needed: the checkpoint's config.json says whether the "
                  "embeddings are tied", file=sys.stderr)
        path = merge(args.backend, args.local_dir, args.target_dir, dtype=args.dtype,
                     hf_model_path=args.hf_model_path, trust_remote_code=args.trust_remote_code)
    except MergeError as exc:
        print(f"model_merger error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {args.local_dir} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
