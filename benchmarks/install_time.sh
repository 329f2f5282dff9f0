#!/bin/bash
# `make install` from scratch, as a new user runs it, with each recipe line's seconds (issue 53 item 6).
#
#   benchmarks/install_time.sh COMMIT [LABEL]
#
# A fresh clone of COMMIT under /tmp/pdserve-install-<LABEL>, an empty venv, empty uv and pip caches,
# an empty torch extension directory and pdserve cache there (the shared ~/.cache ones are neither read
# nor written). make runs every recipe line through a shell that logs its wall seconds; lines run side
# by side (make -j) overlap. Prints the whole install's wall time and every line's, then removes the
# clone (KEEP=1 keeps it: e.g. to run `make serve` from that install). Compare commits only inside
# one run, alternating them: the box's load moves every figure.
set -u
commit=$1 label=${2:-$1}
root=/tmp/pdserve-install-$label
rm -rf "$root" && mkdir -p "$root"
git clone --quiet "$(git rev-parse --show-toplevel)" "$root/tree" && git -C "$root/tree" checkout --quiet "$commit"
cat > "$root/timed-shell" <<'EOF'
#!/bin/bash
start=$(date +%s.%N)
/bin/bash "$@"
status=$?
printf '%7.1f s  %s\n' "$(echo "$(date +%s.%N) - $start" | bc)" "$(echo "${@: -1}" | tr '\n' ' ' | cut -c1-120)" >> "$STEP_LOG"
exit $status
EOF
chmod +x "$root/timed-shell"
export TORCH_EXTENSIONS_DIR=$root/torch-extensions PDSERVE_CACHE=$root/pdserve-cache UV_CACHE_DIR=$root/uv-cache \
  PIP_CACHE_DIR=$root/pip-cache STEP_LOG=$root/steps.log
load=$(cut -d" " -f1-3 /proc/loadavg)
start=$(date +%s.%N)
(cd "$root/tree" && make install SHELL="$root/timed-shell" > "$root/make.log" 2>&1)
status=$?
printf '%s (%s): make install exit %d, %.1f s wall (load average before: %s)\n' \
  "$label" "$commit" "$status" "$(echo "$(date +%s.%N) - $start" | bc)" "$load"
grep -v '^ *0\.0 s  #' "$STEP_LOG"
[ "$status" = 0 ] || tail -20 "$root/make.log"
[ -n "${KEEP:-}" ] || rm -rf "$root"
exit $status
