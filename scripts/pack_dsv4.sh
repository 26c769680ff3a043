#!/usr/bin/env bash
# Pack what sglang 0.5.13's DeepSeek-V4 path needs beyond the GPU kit (issue
# #19): writes .bundle/dsv4.tar.xz, which scripts/gpu_stages.sh's `dsv4` stage
# unpacks onto PYTHONPATH / LD_LIBRARY_PATH (scripts/dsv4_env.sh).
#
# Run HERE, from the repo root (needs PyPI):
#   bash scripts/pack_dsv4.sh                 # ~3-4 min (xz -9 of ~115 MB)
#   PYVER=3.11 OUT_TAR=/tmp/dsv4-cp311.tar.xz bash scripts/pack_dsv4.sh
#                                             # the same set for this machine's
#                                             # Python (CPU import checks)
#
# Why: srt/layers/mhc.py imports tilelang at module top (pulled in by
# srt/models/deepseek_v4.py), and tilelang's libtvm.so links libz3.so. The
# kit (../shared/gpu/build_bundle.sh) carries neither.
#
# What the V4 path needs and where it comes from (tilelang 0.1.8's
# Requires-Dist, checked below so that a new requirement fails the pack):
#   tilelang==0.1.8          here (cp38-abi3: one wheel for 3.11 and 3.12)
#   z3-solver==4.15.4.0      here, libz3.so only (tilelang needs <4.15.5)
#   apache-tvm-ffi           the kit (0.1.9; tilelang needs ~=0.1.0, >=0.1.2)
#   torch                    the device image (2.11.0+cu130)
#   numpy, psutil, tqdm      the device image (KINDS.md package list)
#   typing-extensions        the kit (4.16.0)
#   cloudpickle, ml-dtypes   the device image; packed as a fallback too
#                            (fallback/: cloudpickle 3.1.3, ml-dtypes 0.6.0,
#                            CI's pins), put on PYTHONPATH by dsv4_env.sh only
#                            where the image's do not import
#   torch-c-dlpack-ext       NOT packed: 0.1.5 ships addons for torch 2.4-2.9
#                            only, and torch 2.11 has
#                            torch.Tensor.__dlpack_c_exchange_api__ natively,
#                            so tvm_ffi never loads it (tvm_ffi/
#                            _optional_torch_c_dlpack.py returns first); no
#                            tilelang module imports it
#   setuptools, matplotlib, nvidia-cuda-nvcc/cccl: Darwin-only or extras
#
# What is stripped, and why the V4 path does not load it:
#   tilelang/3rdparty/composable_kernel/*   44 MB: AMD's CK headers, put on the
#       include path for HIP targets only (engine/lower.py, jit/adapter/
#       libgen.py hip branches); an empty include/ stays so that tilelang/
#       env.py does not warn at import
#   tilelang/3rdparty/tvm/src               14 MB: TVM's C++ sources; libtvm.so
#       is prebuilt, and the Python side reads tvm/include, tvm/3rdparty only
#   tilelang/3rdparty/cutlass/tools         3 MB: CUTLASS's profiler and
#       utilities; tilelang compiles with -I cutlass/include only
#       (contrib/nvcc.py, jit/adapter/libgen.py)
#   tilelang-0.1.8.dist-info/RECORD         1 MB: pip's uninstall list
#   z3-solver: all but z3/lib/libz3.so (stripped of symbols): nothing
#       imports the z3 Python module (tilelang and its bundled TVM Python
#       never do). Dropped: the z3 binary (22 MB), libz3.so.4.15 (a second
#       copy), headers, the Python module. The library goes to lib/, outside
#       site/: a site/z3/ folder without the module is still importable as a
#       namespace package, and torch's dynamo (torch.fx.experimental.
#       validator, reached by the MoE top-k's torch.compile) takes a
#       successful `import z3` for the real module and fails on z3.ExprRef
#       (2026-12-04, the first V4 launch on the H200). libtvm.so's RUNPATH
#       ($ORIGIN/../../z3/lib) then finds nothing; dsv4_env.sh puts lib/ on
#       LD_LIBRARY_PATH, which the loader searches first
#   __pycache__ everywhere
# Kept whole: tilelang/lib (libtvm.so, libtilelang.so, the CUDA stubs, the
# cython wrapper), tilelang's Python, tilelang/src (TL_TEMPLATE_PATH: the
# tl_templates headers every kernel includes), cutlass/include, TVM's Python
# package (tilelang/env.py puts 3rdparty/tvm/python on sys.path).
#
# Layout of the tarball: site/ (tilelang), lib/ (libz3.so), fallback/
# (cloudpickle, ml_dtypes), MANIFEST. libtvm.so's RUNPATH also names $ORIGIN/../../tvm_ffi/
# lib, which is the kit's /tmp/site, not this site/: dsv4_env.sh puts the
# kit's tvm_ffi/lib on LD_LIBRARY_PATH (tvm_ffi's own import loads it first
# anyway).
#
# Size (measured 2026-12-03): ~26 MB, which with the kit's 45 MB and the
# repo's ~4.5 MB exceeds the 64 MiB one device call carries: see
# DEVELOPERS.md "GPU loop" for the two-call procedure.
set -euo pipefail
PYVER=${PYVER:-3.12}
OUT_TAR=${OUT_TAR:-.bundle/dsv4.tar.xz}
CACHE=${CACHE:-/tmp/pack_dsv4-wheels}/cp${PYVER/./}
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/pack_dsv4.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

TILELANG=tilelang==0.1.8
Z3=z3-solver==4.15.4.0
FALLBACK=(cloudpickle==3.1.3 ml-dtypes==0.6.0)
# tilelang 0.1.8's Requires-Dist names (environment markers and extras
# dropped), each accounted for in the header.
EXPECTED_REQS="apache-tvm-ffi cloudpickle matplotlib ml-dtypes numpy nvidia-cuda-cccl nvidia-cuda-nvcc psutil setuptools torch torch-c-dlpack-ext tqdm typing-extensions z3-solver"

PLAT=(--only-binary=:all: --python-version "$PYVER" --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
mkdir -p "$CACHE"
echo "== wheels (cp${PYVER/./}) into $CACHE"
for p in "$TILELANG" "$Z3" "${FALLBACK[@]}"; do
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$CACHE" "$p" 2>&1 | grep -v '^WARNING: Location' || true
done
whl() {  # whl NAME VERSION: the cached wheel's path
  local f; f=$(ls "$CACHE"/"$1"-"$2"-*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "no wheel $1-$2 in $CACHE" >&2; exit 1; }
  echo "$f"
}
TL_WHL=$(whl tilelang 0.1.8)
Z3_WHL=$(whl z3_solver 4.15.4.0)

got=$(unzip -p "$TL_WHL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: *\([A-Za-z0-9_.-]*\).*/\1/p' \
      | tr 'A-Z_' 'a-z-' | sort -u | tr '\n' ' ' | sed 's/ $//')
if [ "$got" != "$EXPECTED_REQS" ]; then
  echo "tilelang's Requires-Dist changed: got [$got], expected [$EXPECTED_REQS];" \
       "account for the difference in this script's header" >&2
  exit 1
fi
unzip -p "$Z3_WHL" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'python_version < "3.9"' \
  && { echo "z3-solver has requirements beyond importlib-resources (<3.9)" >&2; exit 1; }

echo "== stage and strip"
W=$WORK/wheel S=$WORK/stage/site L=$WORK/stage/lib F=$WORK/stage/fallback
mkdir -p "$W/tl" "$W/z3" "$S" "$L" "$F"
unzip -q "$TL_WHL" -d "$W/tl"
unzip -q "$Z3_WHL" -d "$W/z3"
cp -r "$W/tl/tilelang" "$W"/tl/tilelang-*.dist-info "$S/"
rm -rf "$S"/tilelang/3rdparty/composable_kernel "$S"/tilelang/3rdparty/tvm/src \
       "$S"/tilelang/3rdparty/cutlass/tools
mkdir -p "$S"/tilelang/3rdparty/composable_kernel/include
rm -f "$S"/tilelang-*.dist-info/RECORD
cp "$W"/z3/z3/lib/libz3.so "$L/"
strip --strip-unneeded "$L/libz3.so"
for p in "${FALLBACK[@]}"; do
  n=${p%%==*}; v=${p##*==}
  unzip -q -o "$(whl "${n//-/_}" "$v")" -d "$F"
done
rm -f "$F"/*.dist-info/RECORD
find "$WORK/stage" -name __pycache__ -prune -exec rm -rf {} +
for f in "$S"/tilelang/lib/*.so; do
  # every library libtvm.so / libtilelang.so need must be in the image, the
  # kit (libtvm_ffi.so) or here (libz3.so, tilelang's own stubs)
  readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | while read -r n; do
    case $n in
      libc.so.6|libm.so.6|libdl.so.2|libpthread.so.0|librt.so.1|ld-linux-x86-64.so.2|libstdc++.so.6|libgcc_s.so.1) ;;
      libtvm_ffi.so) ;;  # the kit's apache-tvm-ffi
      libz3.so) [ -f "$L/libz3.so" ] || { echo "libz3.so missing" >&2; exit 1; } ;;
      *) [ -f "$S/tilelang/lib/$n" ] || { echo "$(basename "$f") needs $n, not packed" >&2; exit 1; } ;;
    esac
  done
done
{
  echo "sglang-hisparse scripts/pack_dsv4.sh, cp${PYVER/./}, $(date -u +%FT%TZ)"
  for w in "$TL_WHL" "$Z3_WHL"; do echo "site, lib: $(basename "$w") (stripped, see the script)"; done
  for p in "${FALLBACK[@]}"; do echo "fallback: $p"; done
} > "$WORK/stage/MANIFEST"
du -sh "$S" "$L" "$F" | sed 's/^/   staged: /'

echo "== pack"
mkdir -p "$(dirname "$OUT_TAR")"
if [[ "$OUT_TAR" == .bundle/* ]] && ex=$(git rev-parse --git-path info/exclude 2>/dev/null); then
  grep -qx '/.bundle/' "$ex" 2>/dev/null || echo '/.bundle/' >> "$ex"
fi
tar -C "$WORK/stage" -cf - . | xz -T0 -9 > "$OUT_TAR"
size=$(stat -c %s "$OUT_TAR")
echo "== $OUT_TAR: $size bytes ($(( size / 1024 / 1024 )) MiB)"
kit=$(cat .bundle/site.tar.xz.* 2>/dev/null | wc -c)
if [ "$kit" -gt 0 ]; then
  echo "   with the kit's .bundle/site.tar.xz.* ($kit bytes): $(( (size + kit) / 1024 / 1024 )) MiB" \
       "of the 64 MiB a device call carries (plus the work tree)"
fi
