#!/usr/bin/env bash
# tools/slurm_local.sh - a real single-node Slurm on this machine, from Debian's packages, to
# submit the jobs/ scripts to (tests/test_slurm.py calls it; so can you, to try a script).
#
#   tools/slurm_local.sh           # install what is missing, start what is not running, wait
#                                  # until the node is idle; a second or so when all is up
#   tools/slurm_local.sh status    # exit 0 if the cluster answers and the node takes jobs
#   tools/slurm_local.sh stop      # stop the daemons this script started (by their pid files)
#
# What it sets up (as root; Debian 12's Slurm 22.05, no systemd needed):
#   - Debian packages slurmctld slurmd slurm-client munge libpmix-dev, installed only when
#     missing (libpmix-dev: Slurm's mpi_pmix plugin loads libpmix.so, which only the -dev
#     package provides; without it `srun --mpi=pmix` fails)
#   - /etc/slurm/slurm.conf, written only if absent or written by this script before (first
#     line below); a slurm.conf from anyone else is left alone and the script fails
#   - state, spool, pid and log files under /var/lib/gem_mpi_slurm (logs in log/)
#   - munged (as user munge, /run/munge created), slurmctld and the slurmds, started directly
#   - one node, this host, in partition "debug", declared with GEM_SLURM_CPUS CPUs (default
#     128: 101-task jobs fit however few cores the machine has; SlurmdParameters=
#     config_overrides lets slurmd accept more CPUs than it finds). No accounting, no
#     cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none), no memory limits.
#     EnforcePartLimits=ALL: a job that can never run fails at submission, not pending.
#   - two more nodes on this host, gemnode1 and gemnode2 (4 CPUs each), in partition "two",
#     for jobs across nodes: Debian's build has MULTIPLE_SLURMD (scontrol show config), so
#     each is a `slurmd -N NAME` of its own on its own port, with its own spool, pid, log and
#     TmpFS (srun --mpi=pmix's client directories) through %n
#
# The config depends only on the host name, GEM_SLURM_CPUS and the memory size: when one of
# them changes, the config is rewritten and the daemons restarted.
set -euo pipefail

STATE=/var/lib/gem_mpi_slurm
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
MARKER="# gem_mpi local test cluster: written by tools/slurm_local.sh (safe to delete)"
PKGS=(slurmctld slurmd slurm-client munge libpmix-dev)
WAIT_S="${GEM_SLURM_WAIT_S:-90}"
# nodes beside this host's own, on this host too (Debian's Slurm is built with
# MULTIPLE_SLURMD): partition "two", for jobs across two nodes (tests/test_slurm.py)
EXTRA_NODES=(gemnode1 gemnode2)
EXTRA_PORT=6831

say() { printf 'slurm_local.sh: %s\n' "$*" >&2; }
die() {
  say "error: $*"
  exit 1
}

# pid from a pid file if that process is alive (not a zombie: a killed daemon's parent is
# init, which may take its time to reap it) and runs the program named ($2)
live_pid() {
  local file=$1 name=$2 pid stat
  [[ -r $file ]] || return 1
  pid="$(tr -dc '0-9' <"$file")"
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$name" ]] || return 1
  stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }" # the field after "(comm) " is the state
  [[ ${stat:0:1} != [ZX] ]] || return 1
  echo "$pid"
}

node_name() { hostname -s; }

desired_conf() {
  local node cpus mem_mb
  node="$(node_name)"
  cpus="${GEM_SLURM_CPUS:-128}"
  [[ $cpus =~ ^[0-9]+$ && $cpus -ge 1 ]] || die "GEM_SLURM_CPUS must be a positive integer, got '$cpus'"
  mem_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 - 512))
  cat <<EOF
$MARKER
ClusterName=gemlocal
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (default 120): short, for tests
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a job that becomes eligible (after a requeue, a dependency) starts within seconds
SchedulerParameters=sched_interval=2,bf_interval=2
MailProg=/bin/true
SlurmdParameters=config_overrides
ReturnToService=2
EnforcePartLimits=ALL
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
InactiveLimit=0
MinJobAge=600
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
# per node: srun --mpi=pmix's client directory is made under TmpFS, named after the step
# alone, so two nodes on one host would collide in one /tmp
TmpFS=$STATE/tmp/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  # more nodes on this host, each its own slurmd (-N name, its own port): partition "two"
  local name port=$EXTRA_PORT
  for name in "${EXTRA_NODES[@]}"; do
    echo "NodeName=$name NodeHostname=$node NodeAddr=127.0.0.1 Port=$port CPUs=4 Sockets=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=1024 State=UNKNOWN"
    port=$((port + 1))
  done
  echo "PartitionName=two Nodes=$(IFS=,; echo "${EXTRA_NODES[*]}") Default=NO MaxTime=INFINITE State=UP"
}

install_packages() {
  local installed missing=() p
  installed="$(dpkg-query -W -f='${Package} ${Status}\n' "${PKGS[@]}" 2>/dev/null || true)"
  for p in "${PKGS[@]}"; do
    grep -qx "$p install ok installed" <<<"$installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  say "installing Debian packages: ${missing[*]}"
  # no daemon is started by the packages' scripts: this script starts them itself
  local policy=/usr/sbin/policy-rc.d added_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    added_policy=1
  fi
  local rc=0 log
  log="$(mktemp)"
  {
    apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}"
  } >"$log" 2>&1 || rc=$?
  ((added_policy)) && rm -f "$policy"
  if ((rc != 0)); then
    tail -n 30 "$log" >&2
    rm -f "$log"
    die "apt-get install ${missing[*]} failed (exit $rc)"
  fi
  rm -f "$log"
}

# --- daemons ------------------------------------------------------------------------------
munge_up() { live_pid /run/munge/munged.pid munged >/dev/null; }
ctld_up() { live_pid "$STATE/slurmctld.pid" slurmctld >/dev/null; }
all_nodes() { echo "$(node_name)" "${EXTRA_NODES[@]}"; }
# every node's slurmd (SlurmdPidFile=$STATE/slurmd.%n.pid)
slurmd_up() {
  local n
  for n in $(all_nodes); do
    live_pid "$STATE/slurmd.$n.pid" slurmd >/dev/null || return 1
  done
}

# Runs a daemon with no file descriptor open beyond 0-2: one inherited from the caller
# would live on in the daemon. Under `flock LOCK pytest tests/test_slurm.py` munged kept the
# lock's descriptor, and so the lock, long after the tests ended.
without_inherited_fds() { # command...
  (
    local fd
    for fd in /proc/"$BASHPID"/fd/*; do
      fd="${fd##*/}"
      ((fd > 2)) && eval "exec $fd>&-" 2>/dev/null
    done
    exec "$@"
  )
}

start_munge() {
  munge_up && return 0
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  without_inherited_fds runuser -u munge -- /usr/sbin/munged
  local i
  for ((i = 0; i < 50; i++)); do
    munge_up && return 0
    sleep 0.1
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

stop_daemon() { # pidfile name
  local pid i
  pid="$(live_pid "$1" "$2")" || return 0
  kill -TERM "$pid"
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  say "$2 (pid $pid) ignores SIGTERM: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

node_state() { sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n1; }

# every node idle (or running jobs); a down one is resumed. Fails when one is not.
nodes_ready() {
  local n state ok=0
  for n in $(all_nodes); do
    state="$(node_state "$n")"
    case "$state" in
      idle* | mixed* | allocated* | completing*) ;;
      down* | drain* | fail*)
        # e.g. "Node unexpectedly rebooted" after the machine restarted
        scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
        ok=1
        ;;
      *) ok=1 ;;
    esac
  done
  return "$ok"
}

wait_ready() {
  local deadline=$((SECONDS + WAIT_S)) state=""
  while ((SECONDS < deadline)); do
    if scontrol ping >/dev/null 2>&1; then
      nodes_ready && return 0
      state="$(sinfo -h -N -o '%N %T' 2>/dev/null | tr '\n' ' ')"
    fi
    sleep 0.5
  done
  say "the node is not ready after ${WAIT_S} s (state: ${state:-no answer from slurmctld})"
  tail -n 20 "$STATE/log/slurmctld.log" "$STATE"/log/slurmd.*.log >&2 2>/dev/null || true
  return 1
}

cmd_status() {
  munge_up && ctld_up && slurmd_up && scontrol ping >/dev/null 2>&1 || return 1
  local n
  for n in $(all_nodes); do
    case "$(node_state "$n")" in
      idle* | mixed* | allocated* | completing*) ;;
      *) return 1 ;;
    esac
  done
}

stop_slurmds() {
  local n
  stop_daemon "$STATE/slurmd.pid" slurmd # a config of before the extra nodes
  for n in $(all_nodes); do
    stop_daemon "$STATE/slurmd.$n.pid" slurmd
  done
}

cmd_stop() {
  stop_slurmds
  stop_daemon "$STATE/slurmctld.pid" slurmctld
  stop_daemon /run/munge/munged.pid munged
}

cmd_start() {
  local want restart=0
  want="$(desired_conf)"
  # the fast path, which needs no root: our config, unchanged, and everything up
  if [[ -f $CONF && "$(cat "$CONF")" == "$want" ]] && command -v sinfo >/dev/null &&
    cmd_status; then
    return 0
  fi
  [[ "$(id -u)" == 0 ]] || die "run as root: it installs packages and starts system daemons"
  command -v dpkg-query >/dev/null 2>&1 || die "not a Debian system (no dpkg-query)"
  install_packages

  if [[ -e $CONF ]] && [[ "$(head -n1 "$CONF")" != "$MARKER" ]]; then
    die "$CONF exists and was not written by this script: a real cluster's config is left alone"
  fi
  if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$want" ]]; then
    say "writing $CONF"
    mkdir -p "$CONF_DIR"
    printf '%s\n' "$want" >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    restart=1
  fi
  mkdir -p "$STATE/ctld" "$STATE/log"
  local n
  for n in $(all_nodes); do
    mkdir -p "$STATE/spool/$n" "$STATE/tmp/$n"
  done

  start_munge
  if ((restart)); then
    stop_slurmds
    stop_daemon "$STATE/slurmctld.pid" slurmctld
  fi
  if ! ctld_up; then
    say "starting slurmctld"
    without_inherited_fds slurmctld
  fi
  if ! live_pid "$STATE/slurmd.$(node_name).pid" slurmd >/dev/null; then
    say "starting slurmd"
    without_inherited_fds slurmd
  fi
  for n in "${EXTRA_NODES[@]}"; do
    if ! live_pid "$STATE/slurmd.$n.pid" slurmd >/dev/null; then
      say "starting slurmd -N $n"
      without_inherited_fds slurmd -N "$n"
    fi
  done
  wait_ready
  say "ready: node $(node_name), $(sinfo -h -N -n "$(node_name)" -o '%c CPUs, partition %P, %T' |
    head -n1); nodes ${EXTRA_NODES[*]} in partition two"
}

case "${1:-start}" in
  start) cmd_start ;;
  status) cmd_status ;;
  stop) cmd_stop ;;
  *) die "usage: $0 [start|status|stop]" ;;
esac
