#!/bin/sh
# stop_suites.sh PID...: stop `make test`'s pytest runs and everything they started, within seconds.
# Each run is a session of its own (setsid: PID is its session and group), which whatever it starts stays in
# unless it starts a session itself (bench's link cells, daemons).
# SIGTERM first: tests/conftest.py turns it into KeyboardInterrupt, so the running test's children are killed
# and fixtures stop what they started (Slurm's daemons). After GRACE seconds SIGKILL, twice half a second apart (a
# process may be forked meanwhile): to every process of the runs' sessions, and to those under them.
GRACE=${GRACE:-5}
members() {  # the processes of session $1, and every descendant of $1, from one ps listing
  ps -eo pid=,ppid=,sid= | awk -v root="$1" '{ parent[$1] = $2; if ($3 == root) print $1 } END {
    for (p in parent) { q = p; while (q != "" && q > 1) { if (q == root) { print p; break } q = parent[q] } } }'
}
for pid; do kill -TERM "$pid" 2>/dev/null; done
waited=0
while [ "$waited" -lt "$GRACE" ]; do
  alive=0
  for pid; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && break
  sleep 1; waited=$((waited + 1))
done
for round in 1 2; do
  for pid; do kill -KILL $(members "$pid") 2>/dev/null; done
  sleep 0.5
done
exit 0
