#!/usr/bin/env bash
# GPU smoke on the lent H200 with the ../shared/gpu kit (copied to .gpu/,
# bundle in .bundle/): the tiny random-weight DeepSeek-V3.2 served by the
# stock sglang 0.5.13 server
#   base    without --enable-hisparse
#   ours    --enable-hisparse with this plugin installed
#   fix     --enable-hisparse, this plugin with SGLANG_HISPARSE_NATIVE=1 (SGLang's
#           own data plane plus our argument handling and fixes only)
#   stock   --enable-hisparse without this plugin (0.5.13 as users get it)
# runs the kit's five smoke requests on each and compares logprobs.
# Usage (device): bash scripts/gpu_smoke.sh [TAG...]   (default: ours base stock)
# Results: $OUT/server_TAG.log, $OUT/res_TAG.json, $OUT/summary.txt
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source .gpu/device_env.sh
PROJ=/tmp/proj
if [ ! -f "$PROJ/.ok" ]; then
  python3 scripts/install_tree.py "$PROJ" >/dev/null \
    && touch "$PROJ/.ok" || { echo "cannot install sglang-hisparse"; exit 1; }
fi
HS_CONFIG='{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}'
BASE_PYTHONPATH="$PYTHONPATH"
TAGS=("$@"); [ ${#TAGS[@]} -gt 0 ] || TAGS=(ours base stock)
for tag in "${TAGS[@]}"; do
  start=$(date +%s)
  case $tag in
    base)  PYTHONPATH="$BASE_PYTHONPATH" bash .gpu/serve_once.sh base ;;
    ours)  PYTHONPATH="$PROJ:$BASE_PYTHONPATH" bash .gpu/serve_once.sh ours \
             --enable-hisparse --hisparse-config "$HS_CONFIG" ;;
    fix)   SGLANG_HISPARSE_NATIVE=1 PYTHONPATH="$PROJ:$BASE_PYTHONPATH" bash .gpu/serve_once.sh fix \
             --enable-hisparse --hisparse-config "$HS_CONFIG" ;;
    stock) PYTHONPATH="$BASE_PYTHONPATH" bash .gpu/serve_once.sh stock \
             --enable-hisparse --hisparse-config "$HS_CONFIG" ;;
  esac
  rc=$?
  if [ "$tag" = ours ] || [ "$tag" = fix ]; then dpath="$PROJ:$BASE_PYTHONPATH"; else dpath="$BASE_PYTHONPATH"; fi
  (cd /tmp && PYTHONPATH="$dpath" python3 -c "from importlib.metadata import entry_points as e; print('[$tag] sglang.srt.plugins:', sorted(x.name for x in e(group='sglang.srt.plugins')))") 2>&1 | tee -a "$OUT/summary.txt"
  echo "$tag rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  grep -m3 -E "sglang-hisparse|Traceback|Error" "$OUT/server_$tag.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
done
for pair in "base ours" "base fix" "base stock"; do
  set -- $pair
  [ -f "$OUT/res_$1.json" ] && [ -f "$OUT/res_$2.json" ] || continue
  echo "== compare $1 vs $2" | tee -a "$OUT/summary.txt"
  python3 .gpu/smoke_requests.py --compare "$OUT/res_$1.json" "$OUT/res_$2.json" | tee -a "$OUT/summary.txt"
done
