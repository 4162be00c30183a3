#!/usr/bin/env bash
# Build bench/cpp/launch_bench.cpp into OUT_DIR/liblaunch_bench.so with the machine's own toolchain.
#   bench/cpp/build.sh OUT_DIR            build and link against the driver (libcuda)
#   bench/cpp/build.sh --check            compile only (machines without a driver: CI, laptops)
# Compiler: $CXX, else g++; CUDA headers from $CUDA_HOME, /usr/local/cuda or /usr/local/cuda-13*.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/launch_bench.cpp"
cxx="${CXX:-g++}"

cuda_home=""
for candidate in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12*; do
    if [[ -n "$candidate" && -f "$candidate/include/cuda.h" ]]; then cuda_home="$candidate"; break; fi
done
if [[ -z "$cuda_home" ]]; then
    echo "build.sh: cuda.h not found; set CUDA_HOME to the CUDA toolkit" >&2
    exit 2
fi
flags=(-O2 -std=c++17 -Wall -Wextra -fPIC -I"$cuda_home/include")

if [[ "${1:-}" == "--check" ]]; then
    "$cxx" "${flags[@]}" -fsyntax-only "$src"
    echo "build.sh: $src compiles ($cxx, headers from $cuda_home)"
    exit 0
fi

out_dir="${1:?usage: build.sh OUT_DIR | --check}"
mkdir -p "$out_dir"
out="$out_dir/liblaunch_bench.so"
# libcuda.so (dev symlink or toolkit stub) if the linker finds one, else the driver's libcuda.so.1.
link_dirs=(-L"$cuda_home/lib64/stubs" -L"$cuda_home/targets/x86_64-linux/lib/stubs")
if "$cxx" "${flags[@]}" -shared "$src" -o "$out" "${link_dirs[@]}" -lcuda 2>/dev/null; then
    :
else
    "$cxx" "${flags[@]}" -shared "$src" -o "$out" -l:libcuda.so.1
fi
echo "$out"
