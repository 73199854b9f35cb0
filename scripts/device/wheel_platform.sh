# Sourced by the scripts that pack wheels for the lent GPU machine (prepare_vllm.sh, prepare_verl.sh):
# PLAT, pip's platform options for its image (CPython 3.12, manylinux x86_64), and `git_exclude PATH...`,
# which keeps the packed folders out of git (.git/info/exclude) from the repo root.
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
--platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
--platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"

git_exclude() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for p in "$@"; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
}
