# source scripts/mooncake_env.sh [TAR]: unpack .bundle/mooncake.tar.xz (written
# by scripts/pack_mooncake.sh) once into $MOONCAKE_ROOT (default
# ${TMPDIR:-/tmp}/mooncake) and put it on PYTHONPATH / LD_LIBRARY_PATH, so that
# `from mooncake.engine import TransferEngine` loads without any system
# install. libcurl comes from the bundle only where the machine has none.
# Returns 1 (and says why) when the import still fails.
_mc_tar=${1:-.bundle/mooncake.tar.xz}
MOONCAKE_ROOT=${MOONCAKE_ROOT:-${TMPDIR:-/tmp}/mooncake}
if [ ! -f "$MOONCAKE_ROOT/.ok" ]; then
  if [ ! -f "$_mc_tar" ]; then
    echo "mooncake_env: no $_mc_tar (bash scripts/pack_mooncake.sh, here)" >&2
    return 1 2>/dev/null || exit 1
  fi
  rm -rf "$MOONCAKE_ROOT" && mkdir -p "$MOONCAKE_ROOT" \
    && tar -C "$MOONCAKE_ROOT" -xJf "$_mc_tar" && touch "$MOONCAKE_ROOT/.ok"
fi
export PYTHONPATH="$MOONCAKE_ROOT/site${PYTHONPATH:+:$PYTHONPATH}"
_mc_ld="$MOONCAKE_ROOT/lib"
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libcurl.so.4 '; then
  _mc_ld="$_mc_ld:$MOONCAKE_ROOT/lib-curl"
fi
export LD_LIBRARY_PATH="$_mc_ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export IBV_CONFIG_DIR="$MOONCAKE_ROOT/lib/libibverbs.d"
unset _mc_ld _mc_tar
if ! _mc_err=$("${MOONCAKE_PY:-python3}" -c 'from mooncake.engine import TransferEngine' 2>&1); then
  echo "mooncake_env: the import fails: $(echo "$_mc_err" | tail -1)" >&2
  unset _mc_err
  return 1 2>/dev/null || exit 1
fi
unset _mc_err
