#!/usr/bin/env bash
# Pack the Mooncake transfer engine for the offline GPU machine (issue #18):
# writes .bundle/mooncake.tar.xz, which scripts/gpu_stages.sh's `pd` stage
# unpacks onto PYTHONPATH / LD_LIBRARY_PATH (scripts/mooncake_env.sh).
#
# Run HERE, from the repo root (needs PyPI and the Debian mirror):
#   bash scripts/pack_mooncake.sh            # ~1 min
#
# What goes in:
#   site/mooncake/        of mooncake-transfer-engine-cuda13==0.3.14 (cp312,
#                         the device's Python) only what `from mooncake.engine
#                         import TransferEngine` loads: __init__.py, engine.so,
#                         libasio.so, libetcd_wrapper.so, and the wheel's
#                         bundled libraries engine.so needs (transitively), in
#                         site/mooncake_transfer_engine_cuda13.libs/ (its RPATH)
#   lib/                  libibverbs.so.1, libmlx5.so.1 (+ the verbs provider
#                         config), libnuma.so.1, libnl-3 / libnl-route-3: not
#                         on a CUDA image; TCP needs no RDMA device, only the
#                         symbols
#   lib-curl/             where the machine lacks libcurl.so.4 (put on
#                         LD_LIBRARY_PATH only then): a stub built here that
#                         exports the 12 curl calls engine.so imports, each
#                         failing (curl_easy_init returns NULL, perform
#                         CURLE_FAILED_INIT). sglang initializes the engine
#                         with "P2PHANDSHAKE" metadata, which never uses HTTP,
#                         so curl is linked but not called; an HTTP metadata
#                         server would fail with "libcurl stub" in its error.
#                         PACK_CURL=1 packs Debian's real libcurl and its
#                         closure instead (+5 MB of xz).
# The .debs come from `apt-get download` (this machine's Debian release; the
# device's newer glibc runs them). Nothing of CUDA travels: engine.so links
# libcudart.so.13 (torch's nvidia wheels on the device) and libcuda.so.1 (the
# driver).
set -euo pipefail
VERSION=0.3.14
PKG=mooncake-transfer-engine-cuda13
OUT_TAR=${OUT_TAR:-.bundle/mooncake.tar.xz}
WORK=$(mktemp -d /tmp/pack_mooncake.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
PY=${PY:-python3}

echo "== $PKG==$VERSION (cp312 manylinux_2_28)"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 "$PKG==$VERSION" -d "$WORK/whl"
mkdir -p "$WORK/wheel" "$WORK/stage/site/mooncake" "$WORK/stage/lib" "$WORK/stage/lib-curl"
( cd "$WORK/wheel" && unzip -q "$WORK"/whl/*.whl )
W=$WORK/wheel
S=$WORK/stage
LIBS_DIR=$(cd "$W" && ls -d mooncake_transfer_engine_cuda13.libs)
mkdir -p "$S/site/$LIBS_DIR"
cp "$W/mooncake/__init__.py" "$W/mooncake/engine.so" "$W/mooncake/libasio.so" \
   "$W/mooncake/libetcd_wrapper.so" "$S/site/mooncake/"
cp -r "$W"/mooncake_transfer_engine_cuda13-*.dist-info "$S/site/"

# The wheel's bundled libraries engine.so needs, transitively (by NEEDED name).
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
queue=("$S/site/mooncake/engine.so" "$S/site/mooncake/libasio.so" "$S/site/mooncake/libetcd_wrapper.so")
declare -A seen=()
while [ ${#queue[@]} -gt 0 ]; do
  f=${queue[0]}; queue=("${queue[@]:1}")
  for n in $(needed "$f"); do
    [ -n "${seen[$n]:-}" ] && continue
    seen[$n]=1
    if [ -f "$W/$LIBS_DIR/$n" ]; then
      cp "$W/$LIBS_DIR/$n" "$S/site/$LIBS_DIR/"
      queue+=("$S/site/$LIBS_DIR/$n")
    fi
  done
done

echo "== system libraries (apt-get download)"
mkdir -p "$WORK/deb" "$WORK/root"
DEBS=(libibverbs1 ibverbs-providers libnuma1 libnl-3-200 libnl-route-3-200)
CURL_DEBS=(libcurl4 libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
           libkeyutils1 libcom-err2 libidn2-0 libunistring2 libldap-2.5-0 libsasl2-2
           libnghttp2-14 libpsl5 librtmp1 libssh2-1 libssl3 libgnutls30 libhogweed6
           libnettle8 libgmp10 libtasn1-6 libp11-kit0 libffi8 libzstd1 zlib1g)
[ "${PACK_CURL:-0}" = 1 ] || CURL_DEBS=()
( cd "$WORK/deb" && apt-get download "${DEBS[@]}" "${CURL_DEBS[@]}" >/dev/null )
for d in "$WORK"/deb/*.deb; do dpkg-deb -x "$d" "$WORK/root"; done
R=$WORK/root
pick() {  # pick DIR NAME...: copy each library (following its symlink) into DIR
  local dir=$1; shift
  local n p
  for n in "$@"; do
    p=$(find "$R" -name "$n" \( -type f -o -type l \) | head -1)
    [ -n "$p" ] || { echo "missing $n in the .debs" >&2; exit 1; }
    cp -L "$p" "$dir/$n"
  done
}
pick "$S/lib" libibverbs.so.1 libmlx5.so.1 libnuma.so.1 libnl-3.so.200 libnl-route-3.so.200
# libibverbs loads its providers by the config files in etc/libibverbs.d
# (IBV_CONFIG_DIR); TCP needs none, but an empty list warns at every start.
mkdir -p "$S/lib/libibverbs.d"
cp "$R"/etc/libibverbs.d/mlx5.driver "$S/lib/libibverbs.d/" 2>/dev/null || true
if [ "${PACK_CURL:-0}" != 1 ]; then
  # The stub: every curl symbol engine.so imports (unversioned), failing.
  syms=$(nm -D --undefined-only "$S/site/mooncake/engine.so" | awk '$2 ~ /^curl_/ {print $2}')
  {
    echo '#include <stddef.h>'
    echo 'static const char *why = "libcurl stub (sglang-hisparse pack_mooncake.sh): no HTTP metadata";'
    for n in $syms; do
      case $n in
        curl_easy_init|curl_easy_escape|curl_slist_append) echo "void *$n(void) { return NULL; }" ;;
        curl_easy_strerror) echo "const char *$n(int e) { (void)e; return why; }" ;;
        curl_easy_cleanup|curl_free|curl_slist_free_all|curl_easy_reset) echo "void $n(void *p) { (void)p; }" ;;
        curl_global_init) echo "int $n(long f) { (void)f; return 0; }" ;;
        *) echo "int $n(void) { return 2; /* CURLE_FAILED_INIT */ }" ;;
      esac
    done
  } > "$WORK/curl_stub.c"
  gcc -shared -fPIC -O2 -Wl,-soname,libcurl.so.4 -o "$S/lib-curl/libcurl.so.4" "$WORK/curl_stub.c"
fi
# libcurl's closure beyond glibc and libstdc++ (every NEEDED name found in the .debs).
curl_queue=()
[ "${PACK_CURL:-0}" = 1 ] && curl_queue=(libcurl.so.4)
declare -A cseen=()
while [ ${#curl_queue[@]} -gt 0 ]; do
  n=${curl_queue[0]}; curl_queue=("${curl_queue[@]:1}")
  [ -n "${cseen[$n]:-}" ] && continue
  cseen[$n]=1
  p=$(find "$R" -name "$n" \( -type f -o -type l \) | head -1)
  [ -n "$p" ] || continue  # glibc and friends: the machine's own
  cp -L "$p" "$S/lib-curl/$n"
  for m in $(needed "$S/lib-curl/$n"); do curl_queue+=("$m"); done
done

echo "== strip and pack"
strip --strip-unneeded "$S"/site/mooncake/*.so "$S"/site/"$LIBS_DIR"/*.so* "$S"/lib/*.so* \
  "$S"/lib-curl/*.so* 2>/dev/null || true
mkdir -p "$(dirname "$OUT_TAR")"
echo "$PKG==$VERSION; debs: $(cd "$WORK/deb" && ls | tr '\n' ' ')" > "$S/MANIFEST"
tar -C "$S" -cJf "$OUT_TAR" .
echo "== $OUT_TAR: $(( $(stat -c %s "$OUT_TAR") / 1024 )) KiB"
( cd "$S" && find . -type f | sort | sed 's/^/   /' )
