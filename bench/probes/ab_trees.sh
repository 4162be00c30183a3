#!/usr/bin/env bash
# The small-batch search rows of several commits, interleaved on one GPU machine, to tell a change's cost from
# the machine's run-to-run spread. Here (with git):  bash bench/probes/ab_trees.sh prepare SHA...  puts each
# commit's library and bench/ in ab/SHA (ignored; carry "ab"); on the GPU machine:  bash bench/probes/ab_trees.sh
# run [ROUNDS]  times the working tree ("head") and each ab/SHA in turn: 1M x 768 float32 x 100 at k = 10 and
# 100, 100k x 128 float32 x 100 and 1,000 (host and device-resident inputs); tinyknn alone, lines to stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  prepare) shift
    for sha in "$@"; do
      mkdir -p "ab/$sha"
      git archive "$sha" tinyknn kernels setup.py pyproject.toml $(git ls-tree --name-only "$sha" bench/ | grep '\.py$') |
        tar -x -C "ab/$sha"
    done ;;
  run)
    source .ci/device_env || exit
    for round in $(seq "${2:-2}"); do
      for tree in head $(ls ab); do
        dir=$PWD; [ "$tree" = head ] || dir=$PWD/ab/$tree
        for shape in "--n-data 1000000 --dim 768 --k 10 100 --nq 100" "--n-data 100000 --dim 128 --nq 100 1000"; do
          (cd "$dir" && PYTHONPATH="/tmp/tk-site:$dir" python3 bench/search.py --device cuda --no-install \
            --peers tinyknn-cuda --budget-s 60 --data random $shape --out-dir "$(mktemp -d)" 2>&1 |
            grep "^random" | sed "s/^/$tree round $round: /")
        done
      done
    done ;;
  *) echo "usage: $0 prepare SHA... | run [ROUNDS]" >&2; exit 2 ;;
esac
