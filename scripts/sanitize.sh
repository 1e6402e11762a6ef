#!/usr/bin/env bash
# The C kernels under AddressSanitizer and UBSan: builds kvbus/routing/_ckernels.c with both
# into a temporary directory (the installed kvbus.routing._ckernels is left alone) and fuzzes
# every entry point that reads network bytes against its Python reference
# (scripts/fuzz_kernels_sanitize.py) for SECONDS (default 45; CI: the test command).
# Prints one summary line, "sanitize: clean ..." or "sanitize: FAILED ...", and exits
# non-zero on any sanitizer report or disagreement.
#
#   scripts/sanitize.sh [SECONDS] [--seed N]
#   KVBUS_SANITIZE_SOURCE=path/to/_ckernels.c   another source (e.g. a scratch copy)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=45
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seed) extra+=(--seed "$2"); shift 2 ;;
    *) seconds="$1"; shift ;;
  esac
done
source_file="${KVBUS_SANITIZE_SOURCE:-kvbus/routing/_ckernels.c}"
python="${PYTHON:-.venv/bin/python}"

# gcc's sanitizer runtimes come with it on Debian (libgcc-N-dev pulls libasan and
# libubsan); install them where a stripped image lacks them, as test.sh does redis.
if ! command -v gcc >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc >/dev/null
fi
runtime() { gcc -print-file-name="$1"; }
if [ ! -e "$(runtime libasan.so)" ] || [ ! -e "$(runtime libubsan.so)" ]; then
  major="$(gcc -dumpversion | cut -d. -f1)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "libgcc-${major}-dev" >/dev/null
fi
libasan="$(readlink -f "$(runtime libasan.so)")"

build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
module="$build/_ckernels$suffix"
# -fno-sanitize-recover: the first UBSan report aborts, like ASan's.
if ! gcc -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=all -I"$include" "$source_file" -o "$module"; then
  echo "sanitize: FAILED (could not build $source_file with -fsanitize=address,undefined)"
  exit 1
fi

# ASan's runtime must be loaded first (LD_PRELOAD: python itself is not built with it);
# PYTHONMALLOC=malloc gives every Python object its own malloc block, so a read past a
# bytes object's end meets ASan's red zone rather than a neighbour in pymalloc's arena.
# Leaks are not checked: CPython keeps much alive at exit by design.
log="$build/fuzz.log"
set +e
LD_PRELOAD="$libasan" PYTHONMALLOC=malloc \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$python" scripts/fuzz_kernels_sanitize.py --module "$module" --seconds "$seconds" \
  "${extra[@]}" >"$log" 2>&1
status=$?
set -e
reports="$(grep -cE 'ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer' "$log" || true)"
if [ "$status" -eq 0 ] && [ "$reports" -eq 0 ]; then
  echo "sanitize: clean ($(grep '^fuzz: ' "$log" | tail -1 | sed 's/^fuzz: //'); ASan+UBSan, ${seconds} s)"
  exit 0
fi
grep -E -A25 'ERROR: AddressSanitizer|runtime error:|DISAGREEMENT|Traceback' "$log" | head -60 || tail -40 "$log"
echo "sanitize: FAILED (exit $status, $reports sanitizer reports; $(head -1 "$log"))"
exit 1
