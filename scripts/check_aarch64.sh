#!/usr/bin/env bash
# Portability check: cross-compile the C kernels for aarch64 (Debian's gcc-aarch64-linux-gnu) and run the scalar
# kernels' C tests (kernels/tests/scalar_kernels_test.c) under qemu-aarch64 (Debian's qemu-user).
#
#   scripts/check_aarch64.sh
#
# Installs the cross toolchain and qemu with apt-get when they are missing (as root, or through password-less sudo
# as on a GitHub runner) on a Debian or Ubuntu system. VERBOSE=1 prints every measured error. Steps:
#   1. every kernels/cpu/*.c compiles for aarch64 with the flags of setup.py and -Werror (no x86 intrinsic or
#      header left outside the PI_X86 guards);
#   2. the test program, linked statically against those objects, passes under qemu-aarch64, llama.cpp's K-quant
#      blocks of tests/data/kquant_golden.npz included (unpacked with python3's zipfile);
#   3. on an x86-64 host, the same program built natively passes too, and every result's digest is equal on both:
#      the scalar kernels give the same bits on x86-64 and aarch64.
# Exits non-zero when a step fails. Takes about a minute (most of it compiling).
set -euo pipefail
cd "$(dirname "$0")/.."

CC_A64=${CC_A64:-aarch64-linux-gnu-gcc}
QEMU=${QEMU:-qemu-aarch64}

if ! command -v "$CC_A64" >/dev/null 2>&1 || ! command -v "$QEMU" >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
    echo "installing gcc-aarch64-linux-gnu and qemu-user"
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
      qemu-user >/dev/null
  else
    echo "error: $CC_A64 and $QEMU are needed (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user, as root)" >&2
    exit 1
  fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# setup.py's flags (ISA-neutral: the x86 variants are chosen by the preprocessor), plus -Werror
CFLAGS=(-std=c11 -fopenmp -ffp-contract=off -fvisibility=hidden -Wall -Wextra -Werror -O3 -Ikernels/cpu)

build() { # build <compiler> <out dir>: the kernels' objects and the test program, linked statically
  local cc=$1 out=$2
  mkdir -p "$out"
  local objs=() pids=() pid
  for src in kernels/cpu/*.c; do
    local obj="$out/$(basename "${src%.c}").o"
    "$cc" "${CFLAGS[@]}" -c "$src" -o "$obj" &
    pids+=($!)
    objs+=("$obj")
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || { echo "error: a kernel source does not compile with $cc" >&2; exit 1; }
  done
  # static, so qemu needs no aarch64 sysroot; glibc's warning about libgomp's dlopen in a static program is noise
  if ! "$cc" "${CFLAGS[@]}" -static kernels/tests/scalar_kernels_test.c "${objs[@]}" -lm \
    -o "$out/scalar_kernels_test" 2>"$out/link.log"; then
    cat "$out/link.log" >&2
    exit 1
  fi
}

run() { # run <name> <command...>: the tests, their log in $work/<name>.log
  local name=$1
  shift
  if ! OMP_NUM_THREADS=2 "$@" "$golden" >"$work/$name.log"; then
    grep -v '^digest ' "$work/$name.log"
    echo "error: the scalar kernel tests failed ($name)" >&2
    exit 1
  fi
  if [ "${VERBOSE:-0}" != 0 ]; then grep -v '^digest ' "$work/$name.log"; fi
  echo "$(grep -c '^digest ' "$work/$name.log") results; $(tail -n 1 "$work/$name.log")"
}

echo "== cross-compiling the kernels for aarch64 ($($CC_A64 -dumpversion))"
build "$CC_A64" "$work/aarch64"
if "$CC_A64" "${CFLAGS[@]}" -dM -E kernels/cpu/common.h | grep -q "define PI_X86 1"; then
  echo "error: the aarch64 build sees PI_X86 1" >&2
  exit 1
fi

golden="$work/golden"
mkdir -p "$golden"
if command -v python3 >/dev/null 2>&1; then
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    tests/data/kquant_golden.npz "$golden"
else
  echo "error: python3 is needed to unpack tests/data/kquant_golden.npz" >&2
  exit 1
fi

echo "== running the scalar kernel tests under $QEMU"
run aarch64 "$QEMU" "$work/aarch64/scalar_kernels_test"

case "$(uname -m)" in
  x86_64 | amd64)
    echo "== the same tests built natively (x86-64), and the results compared bit for bit"
    build "${CC:-gcc}" "$work/native"
    run native "$work/native/scalar_kernels_test"
    if ! diff <(grep '^digest ' "$work/native.log") <(grep '^digest ' "$work/aarch64.log"); then
      echo "error: the scalar kernels give other bits on aarch64 than on x86-64 (digests above)" >&2
      exit 1
    fi
    echo "x86-64 and aarch64 scalar results are bit-identical"
    ;;
esac
echo "aarch64 check passed"
