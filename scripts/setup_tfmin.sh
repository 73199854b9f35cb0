#!/usr/bin/env bash
# Creates .venv-tfmin: .venv (run scripts/setup.sh first) with the LOWEST supported transformers
# (verl_async/versions.py TRANSFORMERS_MIN), for CI's second test run (.ci/run).
#
# It is a layer, not a second install: .venv-tfmin holds only transformers==4.56.2 and the
# releases of its own dependencies that .venv's do not satisfy (huggingface-hub < 1,
# tokenizers 0.22); everything else (torch, ray, the test extra, verl_async itself, editable)
# comes from .venv through a .pth file that adds .venv's site-packages after .venv-tfmin's own.
# So it takes seconds and shares .venv's torch. Re-running it is a no-op when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSFORMERS=4.56.2
[ -x .venv/bin/python ] || { echo "setup_tfmin.sh: .venv is missing; run scripts/setup.sh first" >&2; exit 1; }
base_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -x .venv-tfmin/bin/python ] || .venv/bin/python -m venv --without-pip .venv-tfmin
own_site=$(.venv-tfmin/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir (not a bare path line) so that .venv's own .pth files (the editable verl_async) are read too
echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" > "$own_site/_verl_async_base_venv.pth"
# pip from .venv installs into .venv-tfmin (--python); requirements .venv already meets are left there
.venv/bin/python -m pip --python .venv-tfmin/bin/python install -q --disable-pip-version-check "transformers==$TRANSFORMERS"
.venv-tfmin/bin/python - <<EOF
import transformers, torch, verl_async
assert transformers.__version__ == "$TRANSFORMERS", transformers.__version__
print(f"transformers {transformers.__version__} (torch {torch.__version__}) in $(pwd)/.venv-tfmin")
EOF
