#!/usr/bin/env bash
# The fulldepth stage of ci/gpu-run.sh (which sets HXF_SITE, HXF_PYTHONPATH and HXF_FD_OUT): full-depth serving,
# Aphrodite base and LoRA and exllamav3 (its wheel and extension in .cache/ for ci/exllamav3-env.sh: carried, or
# built by the exllamav3-build stage). Resumable: a finished piece is skipped. Results under HXF_FD_OUT (default
# /tmp/hxf-out/fulldepth; bundle: fulldepth-results.tgz beside it).
#   HXF_PRESETS="qwen3.6-27b-full qwen3.5-9b-full"   which full-depth presets (default: the 27B only); NAME:CODEBOOK
#                                                    writes that preset in one codebook (make-tiny --codebook,
#                                                    e.g. qwen3.6-27b-full:mixed: P3's cost at full
#                                                    depth against the preset's mcg), results as NAME-CODEBOOK-*
#   HXF_FD_SECONDS                                   no new piece after this many seconds (default 1500)
#   HXF_FD_KINDS="base exllamav3 lora"               which pieces, in this order ("base lora exllamav3" measures
#                                                    the LoRA cost in one run first)
#   HXF_FD_CONCURRENCY="1,2,...,256"                 the levels of every piece (bench/serving_http.py's default)
#   HXF_FD_PARALLEL=1                                base and lora start at once (each start is ~6-8 min at full
#                                                    depth), each pinning its KV pool (HXF_FD_KV_BYTES,
#                                                    default 28 GiB, with --gpu-memory-utilization 0.3: 16 GiB
#                                                    holds 655 Mamba blocks, under the default --max-num-seqs 1024) so that
#                                                    neither's profiling sees the other; base measures once both
#                                                    are up and every file in HXF_FD_GATE exists (other work on
#                                                    the machine, e.g. /tmp/hxf-out/moe.done), lora once base
#                                                    is done; the idle one only holds its memory. Then exllamav3.
set -uo pipefail
cd "$(dirname "$0")/../.."
SITE="${HXF_SITE:-/tmp/devsite}" OUT="${HXF_FD_OUT:-/tmp/hxf-out/fulldepth}" MODELS="${HXF_FD_MODELS:-/tmp/hxf-fd/models}"
BUDGET="${HXF_FD_SECONDS:-1500}"
mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1 APHRODITE_NO_USAGE_STATS=1 PATH="$SITE/bin:$PATH" PYTHONPATH="${HXF_PYTHONPATH:-$SITE}"
# HXF_FD_NO_INSTALL=1: the caller has installed this project (ci/gpu-run.sh: reinstalling it while another stage
# imports it would race)
[ -n "${HXF_FD_NO_INSTALL:-}" ] || bash ci/site-install.sh "$SITE"
left() { echo $((BUDGET - SECONDS)); }
KINDS="${HXF_FD_KINDS:-base exllamav3 lora}"
wanted() { case " $KINDS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for spec in ${HXF_PRESETS:-qwen3.6-27b-full}; do
  name=${spec%%:*} codebook=(); preset=$name
  [ "$spec" = "$name" ] || { codebook=(--codebook "${spec#*:}"); preset="$name-${spec#*:}"; }
  m="$MODELS/$preset"
  [ -e "$m/manifest.json" ] || /usr/bin/time -f "make-tiny $preset: %e s" python3 -m hybrid_exl3_fixes.cli make-tiny "$m" --preset "$name" "${codebook[@]}"
  python3 -c "import sys; sys.path.insert(0, 'bench'); import memory_calibration as c; from pathlib import Path; c.save_inputs(Path('$MODELS'), Path('$OUT'), '$preset/exl3')"
  engine_args="--gdn-prefill-backend triton --language-model-only"
  if [ "${HXF_FD_PARALLEL:-0}" = 1 ]; then
    pin="--gpu-memory-utilization 0.3 --kv-cache-memory-bytes ${HXF_FD_KV_BYTES:-$((28 << 30))}"
    gates=(); for g in ${HXF_FD_GATE:-}; do gates+=(--wait-for "$g"); done
    rm -f "$OUT/$preset".{base,lora}.{ready,done}
    # the kinds of HXF_FD_KINDS among base and lora; one left out counts as ready and done (nothing to wait for)
    for kind in base lora; do wanted "$kind" || touch "$OUT/$preset.$kind".{ready,done}; done
    pids=()
    for kind in base lora; do
      [ -e "$OUT/$preset.$kind.done" ] && continue
      r="$OUT/$preset-aphrodite-$kind.json"
      if [ -e "$r" ] && grep -q '"rows"' "$r"; then touch "$OUT/$preset.$kind.ready" "$OUT/$preset.$kind.done"; continue; fi
      if [ "$kind" = base ]; then
        wait_args=("${gates[@]}" --wait-for "$OUT/$preset.lora.ready"); adapter=(); port=${HXF_FD_PORT:-8300}
      else
        wait_args=(--wait-for "$OUT/$preset.base.done"); adapter=(--adapter "$m/lora-a"); port=$((${HXF_FD_PORT:-8300} + 1))
      fi
      python3 bench/serving_http.py "$m/exl3" --out "$r" "${adapter[@]}" --port "$port" --deadline "$(left)" \
        ${HXF_FD_CONCURRENCY:+--concurrency "$HXF_FD_CONCURRENCY"} --engine-args "$engine_args $pin" \
        --ready-file "$OUT/$preset.$kind.ready" --done-file "$OUT/$preset.$kind.done" "${wait_args[@]}" \
        > "$OUT/$preset-aphrodite-$kind.stdout" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}" 2>/dev/null
    # whatever happened above, nothing below (bandwidth, exllamav3, an engine started alone) runs before the gate,
    # so that a failed engine start never lets the measurements run beside other work
    for g in ${HXF_FD_GATE:-}; do
      for _ in $(seq 600); do [ -e "$g" ] && break; sleep 2; done
    done
    for kind in base lora; do
      wanted "$kind" || continue
      grep -q '"rows"' "$OUT/$preset-aphrodite-$kind.json" 2>/dev/null \
        || echo "fulldepth: the $kind engine did not measure (see $OUT/$preset-aphrodite-$kind.stdout); not retried alone"
    done
  fi
  # the copy bandwidth of the roofline, with nothing else on the GPU (in parallel mode: after both engines)
  [ -e "$OUT/bandwidth.json" ] || { python3 bench/roofline.py --measure > "$OUT/bandwidth.tmp" \
    && mv "$OUT/bandwidth.tmp" "$OUT/bandwidth.json"; rm -f "$OUT/bandwidth.tmp"; }  # no empty file left to skip on
  cat "$OUT/bandwidth.json" 2>/dev/null
  # default base, then exllamav3, then LoRA: where the time runs out, the Aphrodite / exllamav3 ratio is there first
  for kind in $KINDS; do
    r="$OUT/$preset-$kind.json"; [ "$kind" = exllamav3 ] || r="$OUT/$preset-aphrodite-$kind.json"
    [ -e "$r" ] && grep -q '"rows"' "$r" && continue
    [ "${HXF_FD_PARALLEL:-0}" = 1 ] && [ "$kind" != exllamav3 ] && continue  # measured above, or reported failed
    [ "$(left)" -gt 120 ] || break 2
    if [ "$kind" = exllamav3 ]; then
      ( source ci/exllamav3-env.sh && python3 bench/exllamav3_generator.py "$m/exl3" --out "$r" --deadline "$(left)" \
        ${HXF_FD_CONCURRENCY:+--concurrency "$HXF_FD_CONCURRENCY"} ) \
        > "$OUT/$preset-exllamav3.log" 2>&1
      continue
    fi
    adapter=(); [ "$kind" = lora ] && adapter=(--adapter "$m/lora-a")
    python3 bench/serving_http.py "$m/exl3" --out "$r" "${adapter[@]}" --deadline "$(left)" \
      ${HXF_FD_CONCURRENCY:+--concurrency "$HXF_FD_CONCURRENCY"} \
      --engine-args "$engine_args"
  done
done
tar czf "$(dirname "$OUT")/fulldepth-results.tgz" -C "$OUT" .
echo "== $(date -u +%FT%TZ) done"
