"""Write the built-in repeat task (verl_async.data.builtin) as verl-schema parquet.

    python -m data_preprocess.builtin_task --local_dir ~/data/builtin [--train_size 2000 --val_size 200 --seed 0]

`builtin://train` / `builtin://val` in `data.*_files` generate the default sizes on
first use; this CLI is for other sizes or seeds, or to look at the data.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from verl_async.data import builtin
from verl_async.data.files import write_rows


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=(builtin.__doc__ or "").splitlines()[0])
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/builtin")
    parser.add_argument("--train_size", type=int, default=builtin.SPLIT_SIZES["train"])
    parser.add_argument("--val_size", type=int, default=builtin.SPLIT_SIZES["val"])
    parser.add_argument("--seed", type=int, default=builtin.DEFAULT_SEED,
                        help="train seed; val uses seed + 1 and shares no prompt with train")
    args = parser.parse_args(argv)
    if args.train_size < 1 or args.val_size < 1:
        parser.error("--train_size and --val_size must be >= 1")
    out = os.path.expanduser(args.local_dir)
    written = {
        split: write_rows(rows, os.path.join(out, f"{split}.parquet"))
        for split, rows in builtin.generate_splits(args.train_size, args.val_size, args.seed).items()
    }
    for split, path in written.items():
        print(f"wrote {split}: {path}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
