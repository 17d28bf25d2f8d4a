#!/usr/bin/env bash
# The whole CPU benchmark suite and the main-job comparison, results under benchmarks/results/
# (the `make bench` of this project). Run it on an otherwise idle machine: it warns when the
# 1-minute load average is above 0.5 because the numbers would then measure the other work.
#
#   bash benchmarks/run_all.sh            # full sweep (about 15 minutes on 2 idle cores, estimated)
#   bash benchmarks/run_all.sh --quick    # smoke sizes, results under /tmp (5.6 minutes at load 11)
# Each stage's wall time is printed to stderr.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
if awk -v l="$load" 'BEGIN {exit !(l > 0.5)}'; then
    echo "run_all: warning: load average $load; timings will include other processes' work" >&2
fi
# Full runs time the compiled backends only: the torch (reference) backend's stochastic-rounding
# path takes minutes at 64M elements; it is checked and timed by --quick and the smoke tests.
EXTRA=(--backends native,triton)
OUTDIR=benchmarks/results
if [ "${1:-}" = "--quick" ]; then
    EXTRA=(--quick)
    OUTDIR=${TMPDIR:-/tmp}/fastamp-bench-quick
fi
rc=0
# stage NAME COMMAND...: runs it, records a failure in rc, prints its wall time
stage() {
    local t0=$SECONDS name=$1
    shift
    "$@" || rc=1
    echo "run_all: $name took $((SECONDS - t0)) s" >&2
}
# bench_lowbit adds torchao / bitsandbytes rows when they are importable (benchmarks/README.md)
for b in bench_unscale bench_adamw bench_step bench_lowbit; do
    stage "$b" "$PY" "benchmarks/$b.py" "${EXTRA[@]}" --out "$OUTDIR"
done
# its own options: native CPU only (--backends does not apply), --quick for smoke sizes
if [ "${1:-}" = "--quick" ]; then
    stage bench_host_overhead "$PY" benchmarks/bench_host_overhead.py --quick --out "$OUTDIR"
else
    stage bench_host_overhead "$PY" benchmarks/bench_host_overhead.py --out "$OUTDIR"
fi
if [ "${1:-}" = "--quick" ]; then
    stage compare "$PY" -m fastamp.compare --size tiny --out "$OUTDIR"
else
    stage compare "$PY" -m fastamp.compare --out "$OUTDIR"
fi
exit $rc
