# jobs/lib/common.sh - sourced by the jobs/*.sbatch scripts (then gem_job_start) and by
# jobs/submit_sweep.sh; not run by itself.
#
# It finds the python that has gem_mpi, checks the training options in one process before
# any rank starts, launches `python -m gem_mpi.train` with srun or mpirun inside the
# allocation, and handles the time limit: Slurm's warning (#SBATCH --signal=B:USR1@...)
# reaches this batch shell, which forwards SIGUSR1 to the launcher; srun and mpirun both
# pass SIGUSR1 unchanged to every rank, the master writes a checkpoint, closes the metrics
# file and the ranks exit (gem_mpi exit code 3); the job then requeues itself
# (scontrol requeue) and the next run resumes from the checkpoint (--resume auto), into the
# same metrics file, under the same job id. SIGTERM is not what is forwarded: srun turns a
# SIGTERM into a kill of the whole step, and mpirun kills the ranks a second after it.
#
# The job's exit code, explained by the last gem_jobs line of its log:
#   0    the run finished (the job may have been requeued and resumed on the way)
#   2    gem_mpi rejected the options, the data, the checkpoint or the method
#   3    stopped with a checkpoint and not requeued (GEM_MAX_RESTARTS reached); resubmit
#        with GEM_RUN_NAME=<the run's name> to resume it (GEM_STOPPED_EXIT changes the code)
#   4    the run diverged and was stopped (the last good checkpoint is kept)
#   5    an output could not be written (a full disk, --min-free-mb): free space, resubmit
#        with GEM_RUN_NAME=<the run's name>
#   6    a worker was stuck (sent nothing for --worker-timeout): the job ended after a
#        checkpoint; resubmit with GEM_RUN_NAME=<the run's name>
#   143  stopped by SIGTERM or SIGINT (scancel, preemption): the job ends CANCELLED anyway
#   other  the launcher's exit code: a rank failed (its traceback is in the log)
#
# Environment read here (every one optional):
#   GEM_MPI_PY        python to use (a path, or a name on PATH such as python3)
#   GEM_MPI_VENV      virtualenv whose bin/python is used if GEM_MPI_PY is unset
#                     (default ~/.cache/gem_mpi/venv, what tools/install.sh creates);
#                     when it does not exist, python3 from PATH is used (module load,
#                     conda activate, source venv/bin/activate before sbatch)
#   GEM_LAUNCHER      srun (default) or mpirun
#   GEM_SRUN_MPI      srun's --mpi plugin (default pmix; `srun --mpi=list` shows the site's)
#   GEM_SRUN_ARGS     extra srun arguments (split on spaces)
#   GEM_MPIRUN        the mpirun to use (default: mpirun from PATH)
#   GEM_MPIRUN_ARGS   extra mpirun arguments (split on spaces)
#   GEM_RUN_NAME      the run's file stem (default <job name>_<job id>): metrics
#                     GEM_OUT_DIR/<name>.h5, checkpoints GEM_OUT_DIR/<name>.ckpt/; an
#                     existing name resumes that run from its newest checkpoint
#   GEM_RESUME=1      let a new job resume existing files (the sweep's); without it a new
#                     job refuses to start over another job's files
#   GEM_MAX_RESTARTS  how often the job may requeue itself at the time limit (default 10;
#                     0: stop with a checkpoint and exit 3)
#   GEM_STOPPED_EXIT  exit code of a run stopped with a checkpoint and not requeued
#                     (default 3; 0 where the time limit is the budget, as for AlexNet)
#   GEM_STOP_GRACE    seconds the ranks get to checkpoint and exit after the warning before
#                     the launcher is killed (default 120)
#   GEM_TRAIN_ARGS    extra gem_mpi.train options, after the script's own (the last of a
#                     repeated option wins), split on spaces

GEM_STOP_REASON=""
GEM_LAUNCHER_PID=""
# this checkout's jobs/ (this file's parent's parent); the checkout is above it
GEM_JOBS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC2034 # used by the scripts that source this file
GEM_MPI_REPO="$(dirname "$GEM_JOBS_DIR")"

# the stability sweep's grid (jobs/sweep_stability.sbatch; its #SBATCH --array and --ntasks
# match these defaults): the paper's stability experiment
GEM_SWEEP_METHODS_DEFAULT="gem downpour adaptive"
GEM_SWEEP_WORKERS_DEFAULT="5 10 20 30"

gem_log() { printf '[%(%H:%M:%S)T] gem_jobs: %s\n' -1 "$*" >&2; }

gem_die() { # code message...
  local code=$1
  shift
  gem_log "error: $*"
  exit "$code"
}

# Slurm's variables this job needs: fails with one line outside an allocation.
gem_require_slurm() {
  [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_NTASKS:-} ]] ||
    gem_die 2 "not inside a Slurm allocation: submit with sbatch (see the header)"
}

# What every batch script does first, right after sourcing this file: inside an allocation,
# the job's environment (gem_setup_env), and the python that has gem_mpi (GEM_PY).
gem_job_start() {
  gem_require_slurm
  gem_setup_env
  gem_find_python
}

# GEM_RANKS: GEM_WORKERS + 1 if set (at most the job's tasks), else all the job's tasks.
# With GEM_NO_MASTER=1 (--method sync) every rank is a worker: GEM_RANKS = GEM_WORKERS.
# GEM_N_WORKERS: the workers among them.
gem_ranks() {
  local tasks="$SLURM_NTASKS" masters="${GEM_MASTERS:-1}" what
  [[ $masters =~ ^[1-9][0-9]*$ ]] ||
    gem_die 2 "GEM_MASTERS must be a positive integer, got '$masters'"
  [[ ${GEM_NO_MASTER:-0} != 1 ]] || masters=0
  if [[ -n ${GEM_WORKERS:-} ]]; then
    [[ $GEM_WORKERS =~ ^[1-9][0-9]*$ ]] ||
      gem_die 2 "GEM_WORKERS must be a positive integer, got '$GEM_WORKERS'"
    ((GEM_WORKERS + masters <= tasks)) || gem_die 2 "GEM_WORKERS=$GEM_WORKERS needs" \
      "$((GEM_WORKERS + masters)) tasks but the job has $tasks: submit with --ntasks=$((GEM_WORKERS + masters))"
    GEM_RANKS=$((GEM_WORKERS + masters))
  else
    ((tasks >= 1 + masters)) ||
      gem_die 2 "needs at least $((1 + masters)) tasks ($masters master(s) + workers), the job" \
        "has $tasks"
    GEM_RANKS=$tasks
  fi
  GEM_N_WORKERS=$((GEM_RANKS - masters))
  what="1 master + $GEM_N_WORKERS workers"
  ((masters <= 1)) || what="$masters masters + $GEM_N_WORKERS workers"
  ((masters)) || what="$GEM_N_WORKERS workers, no master"
  gem_log "job $SLURM_JOB_ID ($SLURM_JOB_NAME) on ${SLURM_JOB_NODELIST:-?}: $GEM_RANKS ranks" \
    "($what), GPUs: ${CUDA_VISIBLE_DEVICES:-none}"
}

# GEM_BATCH: each worker's batch b = B / n for a fixed effective batch B
# (GEM_EFFECTIVE_BATCH, default 1024) over the n = GEM_N_WORKERS workers.
gem_split_batch() {
  local B="${GEM_EFFECTIVE_BATCH:-1024}" n=$GEM_N_WORKERS
  [[ $B =~ ^[1-9][0-9]*$ ]] || gem_die 2 "GEM_EFFECTIVE_BATCH must be a positive integer, got '$B'"
  ((B % n == 0)) || gem_die 2 "the effective batch $B does not split evenly over $n workers" \
    "(use 8 or 16 workers, or set GEM_EFFECTIVE_BATCH)"
  GEM_BATCH=$((B / n))
  gem_log "effective batch $B = $n workers × $GEM_BATCH"
}

# GEM_METHODS and GEM_WORKER_COUNTS (arrays) from GEM_SWEEP_METHODS / GEM_SWEEP_WORKERS.
gem_sweep_grid() {
  read -r -a GEM_METHODS <<<"${GEM_SWEEP_METHODS:-$GEM_SWEEP_METHODS_DEFAULT}"
  read -r -a GEM_WORKER_COUNTS <<<"${GEM_SWEEP_WORKERS:-$GEM_SWEEP_WORKERS_DEFAULT}"
  ((${#GEM_METHODS[@]} && ${#GEM_WORKER_COUNTS[@]})) ||
    gem_die 2 "GEM_SWEEP_METHODS and GEM_SWEEP_WORKERS must not be empty"
  local w
  for w in "${GEM_WORKER_COUNTS[@]}"; do
    [[ $w =~ ^[1-9][0-9]*$ ]] || gem_die 2 "GEM_SWEEP_WORKERS: '$w' is not a positive integer"
  done
}

# Sets GEM_PY; checks that it is python >= 3.11 with gem_mpi and mpi4py importable.
gem_find_python() {
  local venv="${GEM_MPI_VENV:-${HOME:-/nonexistent}/.cache/gem_mpi/venv}" how
  if [[ -n ${GEM_MPI_PY:-} ]]; then
    GEM_PY="$(command -v "$GEM_MPI_PY")" || gem_die 2 "GEM_MPI_PY=$GEM_MPI_PY: no such program"
    how="GEM_MPI_PY"
  elif [[ -x $venv/bin/python ]]; then
    GEM_PY="$venv/bin/python"
    how="virtualenv $venv"
  elif GEM_PY="$(command -v python3)"; then
    how="python3 from PATH"
  else
    gem_die 2 "no python: $venv does not exist and python3 is not on PATH (set" \
      "GEM_MPI_PY, GEM_MPI_VENV, or load your site's python module before sbatch)"
  fi
  local info
  info="$("$GEM_PY" -c 'import sys
if sys.version_info < (3, 11):
    sys.exit("python %s is older than 3.11" % sys.version.split()[0])
import gem_mpi, mpi4py
print(gem_mpi.__version__, gem_mpi.__file__)' 2>&1)" ||
    gem_die 2 "$GEM_PY ($how) cannot run gem_mpi: ${info##*$'\n'}"
  gem_log "python: $GEM_PY ($how), gem_mpi $info"
}

gem_setup_env() {
  export PYTHONFAULTHANDLER=1 # a rank that crashes or hangs in C code dumps its Python stack
  export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
  if [[ "$(id -u)" == 0 ]]; then # mpirun refuses root without these (containers, CI)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  # Open MPI busy-polls while a rank waits in MPI. When the node gave this job more CPUs
  # than it has cores (a node declared larger than it is, as tools/slurm_local.sh does),
  # the spinning ranks starve the working ones: 101 ranks on 2 cores took ~100 s to start
  # instead of ~20 s. Then the ranks yield the CPU while they wait.
  local cores
  cores="$(nproc)"
  if ((${SLURM_CPUS_ON_NODE:-0} > cores)) && [[ -z ${OMPI_MCA_mpi_yield_when_idle:-} ]]; then
    export OMPI_MCA_mpi_yield_when_idle=1
    gem_log "this node has $cores cores for ${SLURM_CPUS_ON_NODE} CPUs of the job:" \
      "OMPI_MCA_mpi_yield_when_idle=1"
  fi
}

# Checks the options with gem_mpi's own validation (gem_mpi.run.preflight), in one process,
# before launching every rank: a bad option costs a second, not a 101-rank start. The data is
# checked too (present, intact, a batch for each worker's share: gem_mpi.run.preflight.validate),
# and again by rank 0 of the real run. Exits 2 with gem_mpi's message on a bad option;
# does nothing if this gem_mpi has no such validation (then the run reports it).
gem_preflight() { # ntasks train-args...
  local msg rc=0
  msg="$("$GEM_PY" - "$@" 2>&1 <<'PY'
import sys
try:
    from gem_mpi import config
    from gem_mpi.errors import GemError
    from gem_mpi.run.preflight import validate
    parse = config.parse
except (ImportError, AttributeError) as exc:
    print(f"skipped ({type(exc).__name__}: {exc})")
    sys.exit(0)
try:
    cfg, _ = parse(sys.argv[2:])
    if cfg is not None:
        validate(cfg, int(sys.argv[1]))
except GemError as exc:
    print(exc)
    sys.exit(3)
PY
)" || rc=$?
  case $rc in
    0) [[ -z $msg ]] || gem_log "option check $msg" ;;
    3) GEM_PREFLIGHT_ERROR="$msg" ;;
    *) gem_die 1 "option check failed to run: $msg" ;;
  esac
  [[ $rc != 3 ]] || return 3
}

# The launch command for n ranks, in the array GEM_CMD; each rank runs jobs/lib/bind.sh
# (GPU per local rank, none for the master) and then the given command.
gem_launch_cmd() { # n command...
  local n=$1
  shift
  local extra=()
  case "${GEM_LAUNCHER:-srun}" in
    srun)
      read -r -a extra <<<"${GEM_SRUN_ARGS:-}"
      # --kill-on-bad-exit: a rank that dies without MPI_Abort (SIGKILL, the OOM killer, a
      # segfault, a lost node) ends the step at once; without it the workers would poll a
      # dead master's stop word forever, or the master wait --worker-timeout for a dead
      # worker. Every rank of a run exits with the run's code (2 bad input, 3 stopped, 4
      # diverged), the files written before any rank exits; srun may still end the slower
      # ranks and report 143 instead. A stop at the time limit requeues all the same (the
      # script knows it sent SIGUSR1), and gem_mpi's own line in the log says what happened
      GEM_CMD=(srun --mpi="${GEM_SRUN_MPI:-pmix}" --ntasks="$n" --kill-on-bad-exit=1)
      # Slurm 22.05's srun does not inherit sbatch's --cpus-per-task
      [[ -z ${SLURM_CPUS_PER_TASK:-} ]] || GEM_CMD+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
      ;;
    mpirun)
      read -r -a extra <<<"${GEM_MPIRUN_ARGS:-}"
      GEM_CMD=("${GEM_MPIRUN:-mpirun}" -n "$n" -x PYTHONFAULTHANDLER -x PYTHONUNBUFFERED)
      # where a model of the user's own is found (examples/*/*.sbatch set it); other
      # variables the user's code reads go in GEM_MPIRUN_ARGS (-x NAME) for other nodes
      [[ -z ${PYTHONPATH:-} ]] || GEM_CMD+=(-x PYTHONPATH)
      ;;
    *) gem_die 2 "GEM_LAUNCHER must be srun or mpirun, got '${GEM_LAUNCHER}'" ;;
  esac
  GEM_CMD+=("${extra[@]}" bash "$GEM_JOBS_DIR/lib/bind.sh" "$@")
}

# The signal handler of the whole job script (installed below, when this file is sourced).
_gem_on_signal() { # USR1 | TERM | INT
  [[ -z $GEM_STOP_REASON ]] || return 0 # already stopping
  GEM_STOP_REASON=$1
  if [[ $1 == USR1 ]]; then
    gem_log "SIGUSR1: the time limit is near (Slurm's --signal) or scancel --signal=USR1:" \
      "the master checkpoints and the run stops"
  else
    gem_log "SIG$1 (scancel, preemption, or the time limit without --signal): stopping"
  fi
  if [[ -z $GEM_LAUNCHER_PID ]]; then # nothing launched yet
    [[ $1 == USR1 ]] || exit 143
    return 0 # gem_train stops before launching
  fi
  kill -0 "$GEM_LAUNCHER_PID" 2>/dev/null || return 0 # the run has ended already
  gem_log "SIGUSR1 to the launcher (pid $GEM_LAUNCHER_PID), which forwards it to every rank"
  kill -USR1 "$GEM_LAUNCHER_PID" 2>/dev/null || true
  # if the ranks do not stop in time, end the launcher (its ranks with it)
  local grace="${GEM_STOP_GRACE:-120}"
  (
    sleep "$grace"
    if kill -0 "$GEM_LAUNCHER_PID" 2>/dev/null; then
      gem_log "the ranks still run ${grace} s after SIGUSR1: SIGKILL to the launcher"
      kill -KILL "$GEM_LAUNCHER_PID" 2>/dev/null || true
    fi
  ) &
  GEM_GRACE_PID=$!
}
GEM_GRACE_PID=""
trap '_gem_on_signal USR1' USR1
trap '_gem_on_signal TERM' TERM
trap '_gem_on_signal INT' INT

# Runs GEM_CMD in the background and waits for it; sets GEM_RC. A signal interrupts the
# wait, _gem_on_signal forwards it, and the wait goes on until the launcher has exited.
gem_run_launcher() {
  gem_log "launching: ${GEM_CMD[*]}"
  "${GEM_CMD[@]}" &
  GEM_LAUNCHER_PID=$!
  # a warning that came just before $! was known: pass it on now
  [[ -z $GEM_STOP_REASON ]] || kill -USR1 "$GEM_LAUNCHER_PID" 2>/dev/null || true
  local rc
  while :; do
    rc=0
    wait "$GEM_LAUNCHER_PID" || rc=$?
    # wait returns > 128 when a trapped signal interrupts it; the launcher may still run
    ((rc > 128)) && kill -0 "$GEM_LAUNCHER_PID" 2>/dev/null && continue
    if ((rc > 128)); then # it ended while the trap ran: its own status, if not yet taken
      local again=0
      wait "$GEM_LAUNCHER_PID" 2>/dev/null || again=$?
      ((again == 127)) || rc=$again
    fi
    break
  done
  if [[ -n $GEM_GRACE_PID ]]; then
    kill "$GEM_GRACE_PID" 2>/dev/null || true
    wait "$GEM_GRACE_PID" 2>/dev/null || true
  fi
  GEM_RC=$rc
}

# One line about the metrics file: readable?, updates, finished? Returns 1 if unreadable.
gem_check_metrics() { # path
  local out rc=0
  [[ -e $1 ]] || {
    gem_log "metrics: $1 was not created (the run stopped before training began)"
    return 0
  }
  out="$("$GEM_PY" - "$1" 2>&1 <<'PY'
import sys
import h5py
with h5py.File(sys.argv[1], "r", libver="latest", swmr=True) as f:
    n = len(f["updates/clock"])
    unit = "steps" if f.attrs.get("method") == "sync" else "updates"
    finished = float(f["summary/finished"][()])
    print(f"{n} {unit}, {'finished' if finished == 1.0 else 'unfinished'}")
PY
)" || rc=$?
  if ((rc == 0)); then
    gem_log "metrics: $1 is readable: $out"
  else
    gem_log "metrics: $1 is NOT readable: ${out##*$'\n'}"
    return 1
  fi
}

# An elastic job (GEM_NODES=MIN-MAX, jobs/gem_elastic.sbatch): Slurm keeps a requeued job's
# task count, which would hold it to this run's nodes. So it is requeued held, given back its
# node range and the fewest tasks (MIN x --ntasks-per-node), and released: its next run gets
# the nodes free then, and resumes on that many workers. Exits with code $1.
_gem_requeue_elastic() { # code resubmit
  local per="${SLURM_NTASKS_PER_NODE:-1}" min="${GEM_NODES%%-*}" _
  trap '' TERM # the requeue signals this script, which has the job to release first
  if ! scontrol requeuehold "$SLURM_JOB_ID"; then
    gem_log "scontrol requeuehold failed (was the job submitted with --no-requeue?); $2; exit $1"
    exit "$1"
  fi
  for _ in $(seq 60); do
    if scontrol update JobId="$SLURM_JOB_ID" NumNodes="$GEM_NODES" NumTasks="$((min * per))" \
      2>/dev/null && scontrol release "$SLURM_JOB_ID"; then
      gem_log "requeued on any $GEM_NODES nodes of $per tasks each"
      exit "$1"
    fi
    sleep 0.5
  done
  gem_log "could not give job $SLURM_JOB_ID back its node range $GEM_NODES; it is held:" \
    "scontrol update JobId=$SLURM_JOB_ID NumNodes=$GEM_NODES NumTasks=$((min * per));" \
    "scontrol release $SLURM_JOB_ID"
  exit "$1"
}

# After a stop at the time limit: requeue this job (it resumes from the checkpoint) unless
# GEM_MAX_RESTARTS is reached; then exit 3.
_gem_requeue_or_stop() { # stem
  local restarts="${SLURM_RESTART_COUNT:-0}" max="${GEM_MAX_RESTARTS:-10}"
  local resubmit="${GEM_RESUME_HINT:-}"
  [[ -n $resubmit ]] ||
    resubmit="resubmit with GEM_RUN_NAME=$(basename "$1") (and the same GEM_OUT_DIR) to resume"
  local code="${GEM_STOPPED_EXIT:-3}"
  case $GEM_STOP_REASON in
    USR1) ;;
    "")
      gem_log "stopped by a signal sent to the ranks directly (checkpoints: $1.ckpt); not" \
        "requeued; $resubmit; exit $code"
      exit "$code"
      ;;
    *)
      gem_log "stopped by SIG$GEM_STOP_REASON (checkpoints: $1.ckpt); not requeued;" \
        "$resubmit; exit 143"
      exit 143
      ;;
  esac
  if ((restarts >= max)); then
    gem_log "stopped (checkpoints: $1.ckpt); not requeued (restart $restarts," \
      "GEM_MAX_RESTARTS=$max); $resubmit; exit $code"
    exit "$code"
  fi
  gem_log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most $max): the" \
    "next run resumes from the newest checkpoint in $1.ckpt"
  [[ -z ${GEM_NODES:-} ]] || _gem_requeue_elastic "$code" "$resubmit"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    gem_log "scontrol requeue failed (was the job submitted with --no-requeue?); $resubmit;" \
      "exit $code"
    exit "$code"
  fi
  sleep 60 # Slurm ends this script as it requeues the job
  exit "$code"
}

# The whole run: check the options, launch n ranks, explain the outcome, exit. Metrics go to
# STEM.h5, checkpoints to STEM.ckpt/ (--checkpoint-dir), and the run resumes from the newest
# checkpoint there if any (--resume auto): after a requeue, or with a reused GEM_RUN_NAME.
gem_train() { # n stem train-args...
  local n=$1 stem=$2
  shift 2
  # a new job must not pick up another job's files by accident (job ids start again from 1
  # when a cluster's state is wiped): resuming a run in a new job is asked for explicitly
  if [[ ${SLURM_RESTART_COUNT:-0} == 0 && -z ${GEM_RUN_NAME:-} && ${GEM_RESUME:-0} != 1 ]] &&
    [[ -e $stem.h5 || -n "$(ls -A "$stem.ckpt" 2>/dev/null)" ]]; then
    gem_die 2 "$stem.h5 or $stem.ckpt/ exists already (another job's run?): remove it, or" \
      "resubmit with GEM_RESUME=1 to resume it"
  fi
  mkdir -p "$stem.ckpt"
  local args=("$@" --metrics "$stem.h5" --checkpoint-dir "$stem.ckpt" --resume auto) extra=()
  read -r -a extra <<<"${GEM_TRAIN_ARGS:-}"
  args+=("${extra[@]}")
  if ! gem_preflight "$n" "${args[@]}"; then
    gem_die 2 "gem_mpi.train rejects these options: $GEM_PREFLIGHT_ERROR (nothing was launched)"
  fi
  [[ ${SLURM_RESTART_COUNT:-0} == 0 ]] ||
    gem_log "restart $SLURM_RESTART_COUNT of this job: resuming from $stem.ckpt"
  if [[ -n $GEM_STOP_REASON ]]; then # the warning came before the launch
    gem_log "stopped before launching"
    _gem_requeue_or_stop "$stem"
  fi
  gem_launch_cmd "$n" "$GEM_PY" -m gem_mpi.train "${args[@]}"
  local t0=$SECONDS
  gem_run_launcher
  local took=$((SECONDS - t0)) metrics_ok=0
  gem_check_metrics "$stem.h5" || metrics_ok=1
  case $GEM_RC in
    0)
      gem_log "done in ${took} s"
      exit "$metrics_ok"
      ;;
    2) gem_die 2 "gem_mpi rejected the run (its one-line message is above); exit 2" ;;
    3) _gem_requeue_or_stop "$stem" ;;
    4) gem_die 4 "the run diverged and was stopped after ${took} s (see gem_mpi's line" \
      "above; the last good checkpoint is kept); not requeued; exit 4" ;;
    5) gem_die 5 "an output could not be written after ${took} s (gem_mpi's line above says" \
      "which; a checkpoint was kept where one fits); free space and resubmit with" \
      "GEM_RUN_NAME=$(basename "$stem"); exit 5" ;;
    6) gem_die 6 "a worker was stuck after ${took} s (gem_mpi's line above names it; the job" \
      "ended after a checkpoint); resubmit with GEM_RUN_NAME=$(basename "$stem"); exit 6" ;;
  esac
  if [[ -n $GEM_STOP_REASON ]]; then
    # the ranks did not stop by themselves (killed after GEM_STOP_GRACE, or the signal came
    # before they could handle it): the periodic checkpoint, if any, is what a resume uses
    gem_log "the launcher exited with code $GEM_RC after SIG$GEM_STOP_REASON"
    _gem_requeue_or_stop "$stem"
  fi
  gem_die "$GEM_RC" "the launcher exited with code $GEM_RC after ${took} s: a rank failed" \
    "(its traceback, lines starting [rank k], is above)"
}

# Output directory (GEM_OUT_DIR, default runs/ in the submission directory), created.
gem_out_dir() {
  GEM_OUT="${GEM_OUT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs}"
  mkdir -p "$GEM_OUT" || gem_die 2 "cannot create the output directory $GEM_OUT"
}

# File stem of this run: GEM_RUN_NAME, or <job name>_<job id> (a requeued job keeps its id,
# so its next run finds the same files and resumes).
gem_run_name() {
  printf '%s' "${GEM_RUN_NAME:-${SLURM_JOB_NAME:-gem}_${SLURM_JOB_ID:-$$}}"
}
