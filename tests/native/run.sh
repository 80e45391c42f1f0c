#!/bin/sh
# Build tests/native/test_kernels.c with the kernels (every utils/lean/*.c, as utils/lean/build.py compiles them)
# and run it.
#
#   tests/native/run.sh CC OUT_DIR [CFLAGS...] [-- MODE [ARGS...]]
#
# CC: the compiler (gcc, clang, aarch64-linux-gnu-gcc, ...); OUT_DIR: where the binary goes; CFLAGS: the variant's
# flags (-march=..., -fopenmp, -fsanitize=...), after the common ones, so they may override -O3; MODE: check (the
# default), fuzz N, digest. RUNNER, where set, runs the binary (e.g. "qemu-aarch64 -L /usr/aarch64-linux-gnu").
# Examples:
#   tests/native/run.sh gcc /tmp/native -march=native -fopenmp
#   tests/native/run.sh clang /tmp/native -march=x86-64 -- fuzz 1000
#   tests/native/run.sh gcc /tmp/asan -march=native -fopenmp -O1 -g -fsanitize=address,undefined \
#       -fno-omit-frame-pointer -fno-sanitize-recover=all -- fuzz 10000
#   RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" tests/native/run.sh aarch64-linux-gnu-gcc /tmp/arm -fopenmp
set -eu
[ $# -ge 2 ] || { sed -n '5,16p' "$0"; exit 2; }
cc=$1 out=$2
shift 2
flags=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags="$flags $1"; shift; done
[ $# -gt 0 ] && shift  # the "--"
root=$(cd "$(dirname "$0")/../.." && pwd)
lean="$root/utils/lean"
mkdir -p "$out"
# -ffp-contract=off as utils/lean/native.py builds (a product and a sum written apart stay apart); the warnings a
# build without OpenMP (its pragmas) or AVX-512 (64-byte vectors between static functions) gives are expected.
# gcc's own flags as utils/lean/build.py gives them (GCC_FLAGS: a loop's running sum fused as every other sum).
case $("$cc" --version 2>/dev/null) in *clang*) ;; *"Free Software Foundation"*) flags="--param=avoid-fma-max-bits=0 $flags" ;; esac
# shellcheck disable=SC2086
"$cc" -O3 -ffp-contract=off -Wall -Wextra -Wno-unknown-pragmas -Wno-psabi $flags -I"$lean" \
  "$root/tests/native/test_kernels.c" "$lean"/*.c -o "$out/test_kernels" -lm
# OpenMP's threads sleep when idle: spinning ones starve each other on a small shared machine (seconds a call).
export OMP_WAIT_POLICY=passive
[ $# -gt 0 ] || set -- check
# shellcheck disable=SC2086
exec ${RUNNER:-} "$out/test_kernels" "$@"
