# shellcheck shell=bash
# Sourced by scripts/wheel_test.sh and scripts/qemu_test.sh: runs programs on an
# emulated AVX2-only CPU with qemu user mode (Debian package qemu-user).
#   FG_QEMU_CPU=Haswell   the CPU model qemu emulates (qemu-x86_64 -cpu help)
#
# fg_qemu_setup        installs qemu-user if qemu-x86_64 is missing
# fg_qemu CMD ARGS...  runs CMD under qemu-x86_64 -cpu $FG_QEMU_CPU, without
#                      qemu's "TCG doesn't support requested feature" warnings
#                      (printed once per thread: Haswell's pcid, hle, rtm, ...),
#                      with OMP_WAIT_POLICY=passive unless set; with
#                      FG_QEMU_TIMEOUT=S set, killed after S seconds (status 124)
# fg_qemu_hint STATUS BUILD_DIR   explains an "Illegal instruction" (status 132)

FG_QEMU_CPU="${FG_QEMU_CPU:-Haswell}"

fg_qemu_setup() {
  if ! command -v qemu-x86_64 >/dev/null 2>&1; then
    echo "qemu: installing qemu-user"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq qemu-user >/dev/null
  fi
  echo "qemu: $(qemu-x86_64 --version | head -n 1), -cpu $FG_QEMU_CPU"
}

fg_qemu() {
  # stdout goes straight through; stderr through the filter. The status is
  # qemu's: the guest program's, or 128 + signal when it died of one.
  # OpenMP threads that spin while waiting are slow and erratic when emulated
  # (seconds instead of a tenth): they sleep instead (no effect on results).
  local rc
  local limit=()
  [ -n "${FG_QEMU_TIMEOUT:-}" ] && limit=(timeout --kill-after=10 "$FG_QEMU_TIMEOUT")
  { OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}" "${limit[@]}" qemu-x86_64 -cpu "$FG_QEMU_CPU" "$@" 2>&1 1>&3 3>&- |
      { grep --line-buffered -v "TCG doesn't support requested feature" || true; } >&2
    rc=${PIPESTATUS[0]}; } 3>&1
  return "$rc"
}

fg_qemu_hint() {
  local rc="$1" build="${2:-}"
  if [ "$rc" -eq 132 ]; then
    echo "qemu: the program died of SIGILL (Illegal instruction): it uses an instruction the" \
         "emulated $FG_QEMU_CPU CPU does not have, i.e. it was compiled for a newer CPU" \
         "(as FG_NATIVE=ON, -march=native, does on this machine)." >&2
    if [ -n "$build" ] && grep -qs '^FG_NATIVE:BOOL=ON' "$build/CMakeCache.txt"; then
      echo "qemu: $build was configured with FG_NATIVE=ON (-march=native); the default" \
           "(FG_NATIVE=OFF) builds for baseline x86-64 with run-time dispatch." >&2
    fi
  fi
}
