# Run from the repo root on the device: work in the committed snapshot .snap
# (helpers edit the live tree meanwhile), with the wheels and release cache.
cd .snap && ln -sfn ../.whl .whl && ln -sfn ../.gpu .gpu && . .gpu/setup.sh || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader
