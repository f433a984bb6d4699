#!/bin/bash
# A/B of kernels/small_m_fp64.cu: tools/small_m_check.cu built against this tree's kernels/
# and against REV's (git archive), then run in interleaved rounds on the same GPU, one case at
# a time (SMALL_M_CHECK_CASE), so that both sides see the same clocks and the same W-read floor.
# SMALL_M_AB_CHECK=tools/grad_w_check.cu does the same for kernels/small_m_grad_w.cu (its rows:
# M K N, error / bound, kernel us, the write floor, their ratio; any M <= 16 and K x N).
# Needs nvcc and a CUDA GPU (sm_90a build; SMALL_M_AB_ARCH=sm_80 for an A100); repo root as cwd.
#
#   bash tools/small_m_ab.sh REV [ROUNDS [CASE ...]]
#   bash tools/small_m_ab.sh HEAD~1 2 2x8192x8192 16x8192x8192 12x8000x4096
#
# CASE is MxKxN from small_m_check's GPU grid (M in 1 2 3 4 8 9 12 15 16; K x N in 8192 x 8192,
# 4096 x 8192, 8000 x 4096, 4095 x 513, 4096 x 512, 1024 x 1000); default: every M at 8192 x 8192 and 12 x
# 8000 x 4096.  Each line: side (tree / rev), round, then small_m_check's row (max errors in
# float32 ulps, problem 33's and 84's training launchers in us, the floor: half a device copy of
# W, and t33 / floor).  Every check of small_m_check must pass on both sides ("ok"); a failing
# case prints its note instead.  Exit status: 1 when any row is not "ok", 2 on a build error.
set -euo pipefail
REV=${1:?usage: tools/small_m_ab.sh REV [ROUNDS [CASE ...]]}
ROUNDS=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
CASES=("$@")
if [ ${#CASES[@]} -eq 0 ]; then
  CASES=(2x8192x8192 4x8192x8192 8x8192x8192 9x8192x8192 12x8192x8192 16x8192x8192 12x8000x4096)
fi
ARCH=${SMALL_M_AB_ARCH:-sm_90a}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/rev"
git archive "$REV" kernels | tar -x -C "$WORK/rev"
CHECK=${SMALL_M_AB_CHECK:-tools/small_m_check.cu}
nvcc -std=c++17 -O3 -I kernels -arch="$ARCH" "$CHECK" -o "$WORK/tree" &
nvcc -std=c++17 -O3 -I "$WORK/rev/kernels" -arch="$ARCH" "$CHECK" -o "$WORK/rev_check" &
wait -n && wait -n || exit 2
status=0
for round in $(seq 1 "$ROUNDS"); do
  for c in "${CASES[@]}"; do
    M=${c%%x*}
    for side in tree rev; do
      exe="$WORK/tree"; [ "$side" = rev ] && exe="$WORK/rev_check"
      row=$(SMALL_M_CHECK_CASE=$c "$exe" "$((round + 1))" 2>&1 | grep -E "^ +$M +[0-9]+ +[0-9]+ " || true)
      echo "$side r$round $row"
      [[ "$row" == *" ok" ]] || status=1
    done
  done
done
exit $status
