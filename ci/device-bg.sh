#!/usr/bin/env bash
# Run a long job on the GPU machine across several device calls (each call is capped at 10 min;
# the machine stays held while calls follow each other within 30 s).
#   bash ci/device-bg.sh start NAME CMD...   copy this tree to /tmp/hxf-src-NAME (later calls may refresh
#                                            the working copy; two jobs do not share one), run CMD there
#                                            detached (setsid), log
#                                            to /tmp/hxf-bg/NAME.log, exit status to NAME.rc
#   bash ci/device-bg.sh stop NAME           SIGTERM to every process started under NAME (marked HXF_BG_JOB=NAME in
#                                            its environment, whatever its session: the servers have their own),
#                                            SIGKILL to what is left after 20 s. (Run 14: pkill on the job's script
#                                            left its children, an exllamav3 generator among them, running beside
#                                            the next job; SIGINT would not do: bash's background children ignore it.)
#   bash ci/device-bg.sh wait NAME SECONDS [FILE...]
#                                            wait until NAME ends or SECONDS pass, then put the log's
#                                            tail and each FILE that exists into $OUT (exit 0 when
#                                            NAME has ended, 75 while it still runs)
set -uo pipefail
BG=/tmp/hxf-bg
mkdir -p "$BG"
case "${1:-}" in
  start)
    name=$2; shift 2
    src=/tmp/hxf-src-$name
    rm -rf "$src" && cp -a . "$src" && cd "$src" || exit 2
    rm -f "$BG/$name.rc"
    HXF_BG_JOB=$name setsid bash -c '"$@" > '"$BG/$name.log"' 2>&1; echo $? > '"$BG/$name.rc" _ "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$BG/$name.pid"
    echo "started $name (pid $!) in $src, log $BG/$name.log"
    ;;
  stop)
    name=$2
    [ -e "$BG/$name.pid" ] || { echo "no job $name was started here"; exit 2; }
    members() { grep -lzx "HXF_BG_JOB=$name" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; }
    pids=$(members); [ -n "$pids" ] || { echo "$name has ended already"; exit 0; }
    kill -TERM $pids 2>/dev/null
    for _ in $(seq 20); do [ -z "$(members)" ] && break; sleep 1; done
    left=$(members); [ -z "$left" ] || kill -KILL $left 2>/dev/null
    [ -e "$BG/$name.rc" ] || echo 143 > "$BG/$name.rc"  # so that a later wait ends
    echo "stopped $name${left:+ (SIGKILL to what was left after 20 s)}"
    ;;
  wait)
    name=$2 seconds=$3; shift 3
    end=$((SECONDS + seconds))
    while [ ! -e "$BG/$name.rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    mkdir -p "${OUT:-/tmp/out}"
    tail -c 200000 "$BG/$name.log" > "${OUT:-/tmp/out}/$name.log" 2>/dev/null
    for f in "$@"; do [ -e "$f" ] && cp "$f" "${OUT:-/tmp/out}/"; done
    if [ -e "$BG/$name.rc" ]; then echo "$name ended: exit $(cat "$BG/$name.rc")"; exit 0; fi
    echo "$name still running after ${seconds}s"; tail -5 "$BG/$name.log"; exit 75
    ;;
  *) echo "usage: $0 start NAME CMD... | stop NAME | wait NAME SECONDS [FILE...]" >&2; exit 2 ;;
esac
