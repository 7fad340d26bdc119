# Sourced at the start of every device call: deps as wheels, the package
# editable, the trimmed release cache, offline.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site
if ! python3 -c "import gdn_backport_kernels, gdn_backport.patchsets" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; return 1; }
fi
mkdir -p /tmp/cache && [ -d /tmp/cache/trees/0.33.0 ] || tar xJf .gpu/trees.tar.xz -C /tmp/cache
export GDN_BACKPORT_CACHE=/tmp/cache GDN_BACKPORT_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import torch,triton,numpy;print('torch',torch.__version__,'triton',triton.__version__,'numpy',numpy.__version__, torch.cuda.get_device_name())"
