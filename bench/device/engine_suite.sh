#!/usr/bin/env bash
# The real-engine suite on the GPU machine (bench/bench_engine.py), run from
# the repository root of a device call. Resumable: every call continues
# where the previous one stopped while the machine stays warm (see
# bench/device/README.md, "The real-engine suite").
#
#   call 1: carry .engine/site.tar.xz.part-aa    command: bash bench/device/engine_suite.sh
#   call 2: carry .engine/site.tar.xz.part-ab .whl   (same command, within 30 s)
#   call 3+: carry nothing                        (same command)
#
# Exit codes: 0 all steps done; 3 steps remain (call again) or the bundle is
# incomplete (call 1 only copied its part); anything else: a setup failure.
set -uo pipefail
start=$(date +%s)
deadline=${ENGINE_DEADLINE:-560}   # seconds of this call the suite may use
export TRITON_CACHE_DIR=/tmp/engine-cache/triton
export VLLM_CACHE_ROOT=/tmp/engine-cache/vllm
export TORCHINDUCTOR_CACHE_DIR=/tmp/engine-cache/inductor
export PYTHONUNBUFFERED=1
mkdir -p /tmp/parts /tmp/engine-cache

# The bundle arrives in two parts over two calls (64 MiB per call).
for part in .engine/site.tar.xz.part-*; do
  [ -f "$part" ] && [ ! -f "/tmp/parts/${part##*/}" ] && cp "$part" /tmp/parts/
done
if [ ! -d /tmp/site/vllm ]; then
  have=$(ls /tmp/parts/site.tar.xz.part-* 2>/dev/null | wc -l)
  if [ "$have" -lt 2 ]; then
    echo "engine_suite: $have of 2 bundle parts in /tmp/parts; next call: carry .engine/site.tar.xz.part-ab and .whl"
    exit 3
  fi
  echo "engine_suite: unpacking the vLLM bundle"
  cat /tmp/parts/site.tar.xz.part-* | tar xJ -C /tmp || { echo "engine_suite: unpack failed"; exit 4; }
fi
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/libcst ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 4
fi
export PYTHONPATH=/tmp/site
# The editable install points at this call's checkout: redone when the
# repository's path differs from the previous call's.
here=$(cd / && python3 -c "import gdn_backport.patchsets, gdn_backport, os; print(os.path.dirname(os.path.dirname(gdn_backport.__file__)))" 2>/dev/null)
if [ "$here" != "$PWD" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/engine-install.log 2>&1 \
    || { tail -5 /tmp/engine-install.log; exit 4; }
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
ls /tmp/site | grep -m1 '^vllm-.*dist-info'

# ENGINE_STEPS="s5-production s8-doctor" runs only those steps (a session
# finishing what an earlier one left); unset, every step runs.
only=()
for step in ${ENGINE_STEPS:-}; do only+=(--only "$step"); done
elapsed=$(( $(date +%s) - start ))
python3 bench/bench_engine.py --site /tmp/site --results /tmp/engine-results \
  --variants /tmp/variants --deadline $(( deadline - elapsed )) ${OUT:+--out "$OUT"} ${only[@]+"${only[@]}"}
