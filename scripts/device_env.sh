# Source this on the GPU machine (device tool): `source scripts/device_env.sh`.
# Nothing is pip-installed there: every package's src/ goes on PYTHONPATH; carried wheels
# (in .whl/, name it in `carry`) are unpacked into /tmp/site.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if compgen -G "$_root/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$_root"/.whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
for _p in hal tilelang deepgemm deepep kvpool dataengine; do
  PYTHONPATH="$_root/packages/$_p/src${PYTHONPATH:+:$PYTHONPATH}"
done
export PYTHONPATH="$_root/src:$PYTHONPATH"
export PYTHONUNBUFFERED=1
export TILESTACK_CACHE_DIR=/tmp/tilestack-cache
# NVLink multicast stays off on shared hosts (see shared/GPU.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset _root _p
