# DeepSeek-V4's extra packages on the device (issue #19): tilelang 0.1.8 and
# z3-solver's libz3.so, packed here by scripts/pack_dsv4.sh into
# .bundle/dsv4.tar.xz.
#
#   bash scripts/dsv4_env.sh [TAR]     unpack once into $DSV4_ROOT (default
#                                      ${TMPDIR:-/tmp}/dsv4) and stop: the first
#                                      of the two device calls (the kit and this
#                                      tarball do not fit one call's 64 MiB);
#                                      /tmp survives while the machine is warm
#   source scripts/dsv4_env.sh [TAR]   after `source .gpu/device_env.sh` (the
#                                      kit's torch and tvm_ffi): unpack if not
#                                      done yet, put site/ on PYTHONPATH, lib/
#                                      (libz3) and the kit's libtvm_ffi on
#                                      LD_LIBRARY_PATH, cloudpickle / ml_dtypes
#                                      from fallback/ only where the image's
#                                      do not import, then `import tilelang`
#                                      and torch's z3 probe; returns 1 (and
#                                      says why) when either fails
# DSV4_PY: the Python to check with (default python3).
_d4_tar=${1:-.bundle/dsv4.tar.xz}
DSV4_ROOT=${DSV4_ROOT:-${TMPDIR:-/tmp}/dsv4}
_d4_fail() {
  echo "dsv4_env: $*" >&2
  unset _d4_tar _d4_py _d4_err _d4_ffi _d4_z3
  return 1 2>/dev/null || exit 1
}
if [ ! -f "$DSV4_ROOT/.ok" ]; then
  if [ ! -f "$_d4_tar" ]; then
    _d4_fail "neither $DSV4_ROOT/.ok nor $_d4_tar: run 'bash scripts/dsv4_env.sh' in a call that" \
             "carries .bundle/dsv4.tar.xz first (bash scripts/pack_dsv4.sh, here), on the same warm machine"
    return 1 2>/dev/null || exit 1
  fi
  rm -rf "$DSV4_ROOT" && mkdir -p "$DSV4_ROOT" \
    && tar -C "$DSV4_ROOT" -xJf "$_d4_tar" && touch "$DSV4_ROOT/.ok" \
    || { _d4_fail "cannot unpack $_d4_tar into $DSV4_ROOT"; return 1 2>/dev/null || exit 1; }
  echo "dsv4_env: unpacked $_d4_tar into $DSV4_ROOT ($(du -sh "$DSV4_ROOT" | cut -f1))"
fi
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  # executed, not sourced: unpacking was all
  head -3 "$DSV4_ROOT/MANIFEST"
  exit 0
fi
_d4_py=${DSV4_PY:-python3}
export PYTHONPATH="$DSV4_ROOT/site${PYTHONPATH:+:$PYTHONPATH}"
if ! "$_d4_py" -c 'import cloudpickle, ml_dtypes' 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$DSV4_ROOT/fallback"
  echo "dsv4_env: cloudpickle / ml_dtypes from $DSV4_ROOT/fallback"
fi
# libz3.so sits in lib/, outside site/ (pack_dsv4.sh says why), and libtvm.so's
# RUNPATH finds tvm_ffi/lib only where tvm_ffi sits in the same folder, which
# the kit's does not: both come from LD_LIBRARY_PATH.
_d4_ffi=$("$_d4_py" -c 'import os, tvm_ffi; print(os.path.join(os.path.dirname(tvm_ffi.__file__), "lib"))' 2>/dev/null) \
  || { _d4_fail "tvm_ffi does not import (source .gpu/device_env.sh first)"; return 1 2>/dev/null || exit 1; }
export LD_LIBRARY_PATH="$DSV4_ROOT/lib:$_d4_ffi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! _d4_err=$("$_d4_py" -c 'import tilelang; print(tilelang.__file__)' 2>&1); then
  _d4_fail "import tilelang fails: $(echo "$_d4_err" | tail -1)"
  return 1 2>/dev/null || exit 1
fi
# torch's dynamo imports z3 where it can (torch.fx.experimental.validator,
# reached by the MoE top-k's torch.compile): an importable z3 that is not the
# real module (an older tarball's site/z3/ folder) kills the first forward.
if ! _d4_z3=$("$_d4_py" -c 'import torch.fx.experimental.validator' 2>&1); then
  _d4_fail "torch's z3 probe fails with $DSV4_ROOT/site on PYTHONPATH: $(echo "$_d4_z3" | tail -1)"
  return 1 2>/dev/null || exit 1
fi
case $_d4_err in
  "$DSV4_ROOT"/site/*) ;;
  *) echo "dsv4_env: tilelang comes from $(echo "$_d4_err" | tail -1), not $DSV4_ROOT/site" >&2 ;;
esac
unset _d4_tar _d4_py _d4_err _d4_ffi _d4_z3
unset -f _d4_fail
