# Source on the GPU machine (device tool): installs carried wheels, points caches at /tmp.
# Usage: source scripts/gpu_env.sh
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/engine${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
export LLMSERVE_CACHE=${LLMSERVE_CACHE:-/tmp/llmserve-cache}
export PYTHONUNBUFFERED=1
if [ -f .gpu/sharegpt-subset.json ]; then export LLMSERVE_SHAREGPT_PATH=$PWD/.gpu/sharegpt-subset.json; fi
set +e
mkdir -p /tmp/site/bin
command -v python >/dev/null 2>&1 || ln -sf "$(command -v python3)" /tmp/site/bin/python
