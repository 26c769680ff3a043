#!/usr/bin/env bash
# Build the GPU kit's bundle for another supported SGLang pin (issue #21):
# the same recipe as ../shared/gpu/build_bundle.sh (same strip list, same
# small-package list, same layout), with the pin's own versions of the
# packages whose versions SGLang pins exactly. Writes .bundle-VERSION/
# site.tar.xz.* (ignored), which scripts/gpu_stages.sh unpacks instead of the
# kit's when GF_SGLANG=VERSION is set.
#
# Run HERE, from the repo root (needs PyPI), with the kit copied to .gpu/:
#   bash scripts/pack_pin.sh 0.5.17            # ~3 min, 61 MB
#
# The versions below are the pin's Requires-Dist (sglang-VERSION.dist-info/
# METADATA). EXTRA: what the pin imports at module level that neither the
# device image nor the kit's list provides, as scripts/bundle_imports.py
# finds it (run at the end when a local venv of the pin exists, PIN_VENV or
# .venv*). 0.5.17: xgrammar (server_args -> function_call_parser ->
# inkling_detector imports it at the top; 0.5.13 imported it lazily).
#
# A bundle travels without the kit's (~45 MB): 0.5.17's is 61 MB in two
# parts (58 MB + 3 MB), so part .00 goes first in a call of its own, which
# leaves it in /tmp/bundle-0.5.17 on the warm machine; see "Another pin" in
# scripts/gpu_stages.sh.
set -euo pipefail
VERSION=${1:?usage: pack_pin.sh VERSION (e.g. 0.5.17)}
REPO=$(git rev-parse --show-toplevel)
KIT=$REPO/.gpu/build_bundle.sh
[ -f "$KIT" ] || { echo "no $KIT: cp -r ../shared/gpu .gpu first"; exit 2; }

# sglang==VERSION's exact pins of what the kit lists at 0.5.13's versions.
case $VERSION in
  0.5.17) SUBS=(
      "sglang-kernel==0.4.3/sglang-kernel==0.4.5"
      "flashinfer-python==0.6.12/flashinfer-python==0.6.15.post1"
      "sgl-deep-gemm==0.1.2/sgl-deep-gemm==0.1.5.post1"
      "apache-tvm-ffi==0.1.9/apache-tvm-ffi==0.1.11"
      "transformers==5.8.1/transformers==5.12.1")
    EXTRA=(xgrammar==0.2.1)
    STRIP=(xgrammar/lib) ;;  # libxgrammar.a (65 MB): for linking C++ against it, never loaded
  *) echo "pack_pin.sh: no version table for sglang $VERSION (known: 0.5.17)"; exit 2 ;;
esac

WORK=$(mktemp -d /tmp/pack-pin-XXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo/.git/info"
SCRIPT=$WORK/build_bundle.sh
# The kit names its pin in three places: the package list, the wheel-cache
# test and the download of sglang's cp311-tagged wheel.
sed -e "s/sglang==0\.5\.13/sglang==$VERSION/g" -e "s/sglang-0\.5\.13-/sglang-$VERSION-/g" "$KIT" > "$SCRIPT"
for s in "${SUBS[@]}"; do
  old=${s%%/*}; new=${s#*/}
  grep -q "$old" "$SCRIPT" || { echo "pack_pin.sh: the kit no longer lists $old"; exit 1; }
  sed -i "s/${old//./\\.}/$new/" "$SCRIPT"
done
# Stripped beyond the kit's list, just before the kit's script tars the site.
for x in ${STRIP[@]+"${STRIP[@]}"}; do
  sed -i "s#^find \"\$S\" -name __pycache__#rm -rf \"\$S\"/$x\n&#" "$SCRIPT"
done
EXTRA_PKGS="${EXTRA[*]}" CACHE=/tmp/gpu-bundle-cache-$VERSION STAGE=/tmp/gpu-bundle-stage-$VERSION \
  bash "$SCRIPT" "$WORK/repo"
# Every exact pin of the release that the kit carries must now be the
# release's: compare the edited list with the wheel's Requires-Dist.
META=$(unzip -Z1 "/tmp/gpu-bundle-cache-$VERSION"/sglang-"$VERSION"-*.whl | grep 'dist-info/METADATA$')
unzip -p "/tmp/gpu-bundle-cache-$VERSION"/sglang-"$VERSION"-*.whl "$META" \
  | sed -n 's/^Requires-Dist: \([A-Za-z0-9_.-]*\)\(\[[a-z0-9]*\]\)\{0,1\}==\([^ ;]*\).*/\1 \3/p' \
  | while read -r name ver; do
      norm=$(echo "$name" | tr 'A-Z_.' 'a-z--')
      carried=$(grep -oiE "^  .*\b$norm==[^ ]+" "$SCRIPT" | grep -oiE "$norm==[^ ]+" | head -1 || true)
      [ -z "$carried" ] || [ "${carried#*==}" = "$ver" ] \
        || { echo "pack_pin.sh: the bundle carries $carried, sglang $VERSION pins $ver"; exit 1; }
    done
OUT=$REPO/.bundle-$VERSION
mkdir -p "$OUT"; rm -f "$OUT"/site.tar.xz.*  # a JIT cache kept there stays
# The kit splits at 58 MiB; with this work tree (~6 MB, growing with
# docs/gpu-runs) a 58 MiB part no longer fits one 64 MiB carry, so the
# stream is split again at 32 MiB: each part travels in its own call.
cat "$WORK/repo/.bundle"/site.tar.xz.* | split -b 32m -d - "$OUT/site.tar.xz."
echo "$VERSION" > "$OUT/SGLANG_VERSION"
ls "$OUT"/site.tar.xz.* | wc -l > "$OUT/PARTS"
grep -qx "/.bundle-$VERSION/" "$REPO/.git/info/exclude" 2>/dev/null || echo "/.bundle-$VERSION/" >> "$REPO/.git/info/exclude"
ls -la "$OUT"; du -sh "$OUT"
# Would the device import the server with this bundle? (needs a venv of the pin)
for py in ${PIN_VENV:+"$PIN_VENV/bin/python"} "$REPO"/.venv*/bin/python; do
  [ "$("$py" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" = "$VERSION" ] || continue
  python3 "$REPO/scripts/bundle_imports.py" --python "$py" --bundle "$OUT"
  exit $?
done
echo "pack_pin.sh: no local venv of sglang $VERSION (PIN_VENV): the imports were not checked"
