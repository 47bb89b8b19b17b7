#!/bin/bash
# alternating old/new engine runs of mixed (64 requests), prints total seconds
TH=$1; N=${2:-3}; DT=${3:-float32}
for r in $(seq $N); do
  for v in old new; do
    if [ $v = old ]; then
      t=$(cd /tmp && PYTHONPATH=/tmp/octavo-ab/old OCTAVO_CACHE=/tmp/octavo-ab/cache_old /work/main/.venv/bin/python /tmp/octavo-ab/prof_run.py $TH $DT 2>/dev/null | grep total)
    else
      t=$(cd /tmp && /work/main/.venv/bin/python /tmp/octavo-ab/prof_run.py $TH $DT 2>/dev/null | grep total)
    fi
    echo "threads $TH $DT $v $t"
  done
done
