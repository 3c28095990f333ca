#!/usr/bin/env bash
# The runs the performance targets are judged by, each bench printing its own table:
#
#   bash benchmarks/targets.sh ns    [OUT]  # NS at the five target shapes, two processes, peers in each
#   bash benchmarks/targets.sh steps [OUT]  # both Llama step stacks against torch.optim.Muon
#   bash benchmarks/targets.sh moe   [OUT]  # the MoE step against torch.optim.Muon
#   bash benchmarks/targets.sh all   [OUT]  # the three in turn
#
# On one GPU, from the repository root or anywhere. The packages run from this checkout
# (their src/ folders go in front of PYTHONPATH, which keeps what it held: quack-kernels or
# gram-newton-schulz installed beside them stay importable). Each bench's log goes to OUT
# (default: $OUT, else the current directory). Without quack-kernels and gram-newton-schulz
# their column is left out, and `auto` picks among the kernels it has.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-all}
out=${2:-${OUT:-.}}
mkdir -p "$out"
src=$(ls -d "$root"/packages/*/src | paste -sd:)
export PYTHONPATH="$src:$root/testing${PYTHONPATH:+:$PYTHONPATH}"

ns() {
  for run in 1 2; do
    echo "## NS, process $run"
    python3 "$root/benchmarks/ns_bench.py" \
      --shapes 1024x4096 2048x8192 4096x4096 4096x14336 8192x28672 \
      --methods "dmuon[auto]" "torch.optim.Muon NS" "gram-newton-schulz+quack" \
      --rounds 3 --rep-ms 300 --budget-s 150 --out "$out" | tee "$out/ns-$run.txt"
  done
}

steps() {
  for config in 2048x8192x16 4096x14336x8; do
    echo "## step, $config"
    python3 "$root/benchmarks/step_bench.py" --config "$config" --variants torch-muon,dmuon \
      | tee "$out/step-$config.txt"
  done
}

moe() {
  echo "## MoE step"
  python3 "$root/benchmarks/moe_bench.py" --layers 4 | tee "$out/moe.txt"
}

case $what in
  ns | steps | moe) "$what" ;;
  all) ns && steps && moe ;;
  *) echo "usage: bash benchmarks/targets.sh {ns|steps|moe|all} [OUT]" >&2 && exit 2 ;;
esac
