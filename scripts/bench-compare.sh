#!/usr/bin/env bash
# The library's benchmarks before and after a change, in one run: the
# commit BASE is checked out beside this tree (a git worktree in a
# temporary folder, its own target directory), both are built first, then
# each benchmark runs on BASE and on this tree one after the other, ROUNDS
# times, so the two see the same machine at nearly the same moment (this
# kind of VM drifts within a day: docs/benchmarks.md). Every line each run
# prints is kept, prefixed with `before` or `after`; compare the same row's
# numbers, and each row's ratio to the baseline it measures in its own run.
#
#   bash scripts/bench-compare.sh BASE [BENCH...]
#
# BENCH: the benchmarks of the library crate to compare (default:
# read_accounting heartbeat_schedule release_storm). Environment: ROUNDS
# (1 by default), QUICK=1 to pass `--quick` (shorter runs, noisier).
# Builds offline from what is already fetched (`--locked`), downloads
# nothing; exits non-zero when a build or a run fails.
set -euo pipefail

base=${1:?usage: scripts/bench-compare.sh BASE [BENCH...]}
shift
benches=("$@")
if [ ${#benches[@]} -eq 0 ]; then
    benches=(read_accounting heartbeat_schedule release_storm)
fi
rounds=${ROUNDS:-1}
extra=()
if [ "${QUICK:-0}" = 1 ]; then
    extra=(--quick)
fi

root=$(git rev-parse --show-toplevel)
cd "$root"
base_rev=$(git rev-parse --verify "$base^{commit}")
head_rev=$(git rev-parse HEAD)
scratch=$(mktemp -d)
tree="$scratch/base"
git worktree add --quiet --detach "$tree" "$base_rev"
cleanup() {
    git -C "$root" worktree remove --force "$tree" || true
    rm -rf "$scratch"
}
trap cleanup EXIT
# The base's build in a target directory of its own, kept between runs so
# a second comparison with the same base builds nothing.
base_target="$root/target/bench-base"

build() { # DIR TARGET
    local dir=$1 target=$2
    for b in "${benches[@]}"; do
        (cd "$dir" && CARGO_TARGET_DIR="$target" cargo bench --locked --bench "$b" --no-run) >&2
    done
}
echo "building the base ($base_rev) and this tree ($head_rev$(git diff --quiet HEAD || echo ', with uncommitted changes'))" >&2
build "$tree" "$base_target"
build "$root" "$root/target"

run() { # LABEL DIR TARGET BENCH
    local label=$1 dir=$2 target=$3 bench=$4
    (cd "$dir" && CARGO_TARGET_DIR="$target" cargo bench --locked --bench "$bench" -- "${extra[@]}" 2>&1) |
        sed "s/^/$label | /"
    return "${PIPESTATUS[0]}"
}

echo "bench-compare: before = $base_rev, after = $head_rev, $(nproc) cores, $(date -u +%FT%TZ)"
for ((r = 1; r <= rounds; r++)); do
    for b in "${benches[@]}"; do
        echo "== $b, round $r of $rounds"
        run before "$tree" "$base_target" "$b"
        run after "$root" "$root/target" "$b"
    done
done
