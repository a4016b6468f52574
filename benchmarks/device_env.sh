# Sourced by the device session scripts (run from the repository root): unpack the bundles a device call carries
# (CuTe-DSL as .cutedsl/*.tar.xz, apache-tvm-ffi as .whl/tvm_ffi_cp312.tar.xz: benchmarks/README.md) and put them
# and the repository on PYTHONPATH.
if [ -d .cutedsl ]; then
    mkdir -p /tmp/cutedsl && for f in .cutedsl/*.tar.xz; do tar xJf "$f" -C /tmp/cutedsl; done
fi
if [ -f .whl/tvm_ffi_cp312.tar.xz ]; then
    mkdir -p /tmp/site && tar xJf .whl/tvm_ffi_cp312.tar.xz -C /tmp/site
fi
export PYTHONPATH=/tmp/site:/tmp/cutedsl/nvidia_cutlass_dsl/dsl_packages:/tmp/cutedsl:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
