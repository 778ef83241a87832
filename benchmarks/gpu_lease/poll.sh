#!/usr/bin/env bash
# Waits up to $1 seconds (default 500) for /tmp/res/$2 (default all.done) on the GPU machine, then
# tars /tmp/res into $OUT/res.tgz and prints the lease's step log: one call keeps the machine held.
#
#   bash benchmarks/gpu_lease/poll.sh 500 suite.done
limit=${1:-500}; flag=${2:-all.done}; start=$(date +%s)
while [ ! -e "/tmp/res/$flag" ] && [ $(( $(date +%s) - start )) -lt "$limit" ]; do sleep 5; done
[ -e "/tmp/res/$flag" ] && echo "$flag after $(( $(date +%s) - start )) s" || echo "no $flag after $limit s"
tar czf "${OUT:-/tmp}/res.tgz" -C /tmp res 2>/dev/null
cat /tmp/res/steps.log 2>/dev/null; tail -5 /tmp/lease.log 2>/dev/null
