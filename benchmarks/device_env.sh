# Sourced by the device session scripts (run from the repository root): unpack the bundles a device call carries
# (CuTe-DSL as .cutedsl/*.tar.xz, apache-tvm-ffi as .whl/tvm_ffi_cp312.tar.xz, the tree's packed paths as
# .devtree/rest.tar.xz; or the second half of the two-call form, .cutedsl_b/: benchmarks/README.md) and put them
# and the repository on PYTHONPATH.
if [ -f .devtree/rest.tar.xz ]; then
    tar xJf .devtree/rest.tar.xz
fi
if [ -d .cutedsl ]; then
    mkdir -p /tmp/cutedsl && for f in .cutedsl/*.tar.xz; do tar xJf "$f" -C /tmp/cutedsl; done
fi
# The two-call form: the first call's .cutedsl_a/ is unpacked into /tmp (the libraries' first part kept there), and
# the second call's .cutedsl_b/ completes the libraries.
if [ -d .cutedsl_a ]; then
    mkdir -p /tmp/cutedsl /tmp/site
    tar xJf .cutedsl_a/core.tar.xz -C /tmp/cutedsl
    cp .cutedsl_a/libs.part.aa /tmp/
    tar xJf .cutedsl_a/tvm_ffi_cp312.tar.xz -C /tmp/site
fi
if [ -f .cutedsl_b/libs.part.ab ]; then
    if [ -f /tmp/libs.part.aa ]; then
        cat /tmp/libs.part.aa .cutedsl_b/libs.part.ab | xz -dc | tar xf - -C /tmp/cutedsl
    else
        echo "device_env.sh: no /tmp/libs.part.aa (a fresh machine?): carry .cutedsl_a in a call first" >&2
    fi
fi
if [ -f .whl/tvm_ffi_cp312.tar.xz ]; then
    mkdir -p /tmp/site && tar xJf .whl/tvm_ffi_cp312.tar.xz -C /tmp/site
fi
export PYTHONPATH=/tmp/site:/tmp/cutedsl/nvidia_cutlass_dsl/dsl_packages:/tmp/cutedsl:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
