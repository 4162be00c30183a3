#!/usr/bin/env bash
# The screen's knobs measured on the H200 in one call (each setting a fresh index, answers compared across
# settings by screen_steps): the screen graphs on the small batches they aim at; three consumers (CW, the default)
# against two and the halves' overlap (XO, with two) on 10M x 128 uint8 x 2,048 at k = 10 and 100, XO on float16
# too; lean tiles (LT); Nsight Compute of the 8-bit screen, of what limits the rows short of their goals
# (ceiling) and of each SASS line (sass, sass-lean); memcheck of CW and XO. Logs and JSON in $OUT.
# Run after .ci/gpu (which runs their tests), carrying .whl:  bash bench/probes/hopper_knobs.sh PART...
# (PART: graphs, overlap, overlap16, consumers, lean, lean-small, half-keys, sample, profile, ceiling, sass,
# sass-lean, memcheck; each 10M-row part a few minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
source .ci/device_env || exit
out="${OUT:-/tmp}" tag="$(date -u +%Y-%m-%dT%H%M)_nvidia-h200_${TREE}"
steps="python3 bench/probes/screen_steps.py --keeps default --steps default"
u8="--n 10000000 --dtype uint8 --ks 10,100 --queries 2048"
f16="--n 10000000 --dtype float16 --ks 10,100 --queries 2048"
ceiling="regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"                 # stall reasons
ceiling="$ceiling,regex:^sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active$"        # pipes busy
ceiling="$ceiling,regex:^sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$"        # and issued to
for part in "${@:-graphs}"; do
  case "$part" in
    graphs)
      $steps --queries 1000 --graphs 0,1,0,1 --out "$out/screen_steps_graphs_100kx128_$tag.json" 2>&1 | tail -20
      $steps --queries 1000 --graphs 0,1 --force-hopper --out "$out/screen_steps_graphs_100kx128_hopper_$tag.json" \
        2>&1 | tail -10
      $steps --n 1000000 --dim 768 --queries 100 --ks 10,100 --graphs 0,1,0,1 \
        --out "$out/screen_steps_graphs_1Mx768_$tag.json" 2>&1 | tail -20 ;;
    overlap) $steps $u8 --hopper-consumers 2 --hopper-overlap 0,1,0,1 --out "$out/screen_steps_overlap_$tag.json" \
        2>&1 | tail -20 ;;
    overlap16) $steps $f16 --hopper-overlap 0,1,0,1 --out "$out/screen_steps_overlap_f16_$tag.json" 2>&1 | tail -20 ;;
    consumers) $steps $u8 --hopper-consumers 2,3,2,3 --out "$out/screen_steps_consumers_$tag.json" 2>&1 | tail -20 ;;
    half-keys)    # HK against the default on 10M x 128 uint8 (k = 10 and 100), then memcheck of its cases
      $steps $u8 --half-keys 0,1,0,1 --out "$out/screen_steps_half_keys_$tag.json" 2>&1 | tail -20
      TINYKNN_SCREEN=wgmma compute-sanitizer --tool memcheck --report-api-errors no python3 tests/gpu_sanitize.py \
        half 2>&1 | tail -8 | tee "$out/sanitize_half_$tag.log" ;;
    lean-small)   # lean tiles on the small tile (batches of at most 128 queries): 1M x 768 float32 x 100
      $steps --n 1000000 --dim 768 --queries 100 --ks 10,100 --lean-tiles 0,1,0,1 \
        --out "$out/screen_steps_lean_small_$tag.json" 2>&1 | tail -20 ;;
    lean) $steps $u8 --lean-tiles 0,1,0,1 --out "$out/screen_steps_lean_$tag.json" 2>&1 | tail -20
      $steps $f16 --lean-tiles 0,1,0,1 --out "$out/screen_steps_lean_f16_$tag.json" 2>&1 | tail -20
      TINYKNN_SCREEN=wgmma compute-sanitizer --tool memcheck --report-api-errors no python3 tests/gpu_sanitize.py \
        lean 2>&1 | tail -8 | tee "$out/sanitize_lean_$tag.log" ;;
    sample)   # the threshold step's sample of every 16th row against every 32nd at k = 10 (0.83 ms of 9.4)
      python3 bench/probes/screen_steps.py --keeps default --steps 16,32,16,32 $u8 --ks 10 \
        --out "$out/screen_steps_sample_$tag.json" 2>&1 | tail -20 ;;
    profile)  # Nsight Compute of the default 8-bit screen kernel on one SIFT-like batch (k = 10)
      ncu --profile-from-start off --clock-control none --kernel-name regex:screen_hopper_kernel \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats --section ComputeWorkloadAnalysis \
        python3 bench/probes/batch_kernels.py --n 10000000 --dtype uint8 --sift-like --queries 2048 --k 10 \
        > "$out/ncu_screen_hopper_uint8_$tag.txt" 2>&1; tail -3 "$out/ncu_screen_hopper_uint8_$tag.txt" ;;
    ceiling)  # the 8-bit and 16-bit screens' stall reasons and pipes (10M x 128 x 2,048, k = 10), and the kernels
              # of one batch of 1,000 float32 queries on 100k x 128 (each kernel's time) and its steps
      for dtype in uint8 float16; do
        rows="--n 10000000 --dtype $dtype --queries 2048 --k 10"; [ $dtype = uint8 ] && rows="$rows --sift-like"
        for metrics in "--metrics $ceiling" ""; do   # without the metrics where this ncu lacks one of them
          ncu --profile-from-start off --clock-control none --kernel-name regex:screen_hopper_kernel \
            --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis $metrics \
            python3 bench/probes/batch_kernels.py $rows > "$out/ncu_ceiling_${dtype}_$tag.txt" 2>&1 && break
        done
        tail -3 "$out/ncu_ceiling_${dtype}_$tag.txt"
      done
      ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
        python3 bench/probes/batch_kernels.py > "$out/ncu_100kx128_float32_$tag.txt" 2>&1
      grep -E "^  [a-z_ ]+.*\(|Duration" "$out/ncu_100kx128_float32_$tag.txt" | cut -c1-110
      $steps --queries 1000 --ks 10 --out "$out/screen_steps_100kx128_$tag.json" 2>&1 | tail -3 ;;
    sass|sass-lean)  # where the 8-bit screen's issued instructions go: its opcodes' counts and each SASS line's
           # executions and stall samples (the screen launch only: the threshold mode's comes first); sass-lean: LT's
      knob=HOPPER_LEAN_TILES=$([ "$part" = sass-lean ] && echo 1 || echo 0)
      ncu --profile-from-start off --clock-control none --kernel-name regex:screen_hopper_kernel --launch-skip 1 \
        --launch-count 1 --section InstructionStats --section SourceCounters --section WarpStateStats \
        --metrics sass__inst_executed_per_opcode --print-metric-instances values -f --export /tmp/screen_u8 \
        python3 bench/probes/batch_kernels.py --n 10000000 --dtype uint8 --sift-like --queries 2048 --k 10 \
        --knob $knob > "$out/ncu_${part}_uint8_$tag.txt" 2>&1; tail -4 "$out/ncu_${part}_uint8_$tag.txt"
      ncu --import /tmp/screen_u8.ncu-rep --page source --csv --print-source sass 2>&1 | xz -6 \
        > "$out/ncu_${part}_lines_uint8_$tag.csv.xz"; python3 bench/probes/sass_lines.py \
        "$out/ncu_${part}_lines_uint8_$tag.csv.xz" ;;
    memcheck)
      for mode in consumers overlap; do
        TINYKNN_SCREEN=wgmma compute-sanitizer --tool memcheck --report-api-errors no python3 tests/gpu_sanitize.py \
          $mode 2>&1 | tail -8 | tee "$out/sanitize_${mode}_$tag.log"
      done ;;
    *) echo "unknown part $part: graphs, overlap, overlap16, consumers, lean, lean-small, half-keys, sample, profile," \
         "ceiling, sass, sass-lean, memcheck" >&2
       exit 2 ;;
  esac
done
