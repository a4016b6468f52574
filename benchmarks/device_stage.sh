# The first call of the two-call form (benchmarks/README.md): unpack what .cutedsl_a/ carries into /tmp, where the
# next call on the same machine finds it (device_env.sh adds the libraries' second part).
set -e
mkdir -p /tmp/cutedsl /tmp/site
tar xJf .cutedsl_a/core.tar.xz -C /tmp/cutedsl
cp .cutedsl_a/libs.part.aa /tmp/
tar xJf .cutedsl_a/tvm_ffi_cp312.tar.xz -C /tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
