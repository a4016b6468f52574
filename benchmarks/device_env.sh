# Sourced by the device session scripts (run from the repository root): unpack the CuTe-DSL bundle that a
# device call carries as .cutedsl, and put it and the repository on PYTHONPATH.
if [ -d .cutedsl ]; then
    mkdir -p /tmp/cutedsl && for f in .cutedsl/*.tar.xz; do tar xJf "$f" -C /tmp/cutedsl; done
fi
export PYTHONPATH=/tmp/cutedsl/nvidia_cutlass_dsl/dsl_packages:/tmp/cutedsl:$PWD
export PYTHONUNBUFFERED=1
