#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for laptops and CI.
#
#   sudo slurm/dev-cluster.sh start  [--state-dir DIR] [--port N] [--timeout S]
#   sudo slurm/dev-cluster.sh status [--state-dir DIR]
#   sudo slurm/dev-cluster.sh stop   [--state-dir DIR]
#
# `start` installs the Debian packages when missing, writes slurm.conf into the
# state directory, starts munged, slurmctld and slurmd there and waits until the
# node is idle. Its only stdout line is `export SLURM_CONF=...`, so
# `eval "$(sudo slurm/dev-cluster.sh start)"` configures the calling shell.
# Nothing is written outside the state directory except the packages themselves;
# a system munged or slurmd, if any, is left alone. See slurm/README.md.
set -euo pipefail

readonly PROG=${0##*/}
# The daemons live in /usr/sbin, which a non-login root shell may lack.
export PATH=$PATH:/usr/sbin:/sbin
readonly PACKAGES=(slurmctld slurmd slurm-client munge)
# The binaries whose absence means the packages must be installed.
readonly REQUIRED_COMMANDS=(munged munge slurmctld slurmd sbatch sinfo squeue scontrol scancel)

usage() {
    cat >&2 <<EOF
usage: $PROG start|stop|status [--state-dir DIR] [--port N] [--timeout S]

  start    install packages if missing, start munged, slurmctld, slurmd; wait until
           the node is idle; print the 'export SLURM_CONF=...' line (stdout)
  stop     cancel this cluster's jobs and stop the daemons it started (safe to repeat)
  status   print sinfo and squeue; exit 1 when the cluster is down

  --state-dir DIR  config, state, logs, pid files (default: \$WINNOW_SLURM_STATE_DIR
                   or /tmp/winnow-slurm)
  --port N         slurmctld port; slurmd uses N+1 (default: \$WINNOW_SLURM_PORT or 6817)
  --timeout S      seconds start waits for an idle node (default: 60)
EOF
    exit 2
}

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

[[ $# -ge 1 ]] || usage
readonly COMMAND=$1
shift
STATE_DIR=${WINNOW_SLURM_STATE_DIR:-/tmp/winnow-slurm}
CTLD_PORT=${WINNOW_SLURM_PORT:-6817}
START_TIMEOUT_S=60
while [[ $# -gt 0 ]]; do
    case $1 in
        --state-dir) [[ $# -ge 2 ]] || usage; STATE_DIR=$2; shift 2 ;;
        --state-dir=*) STATE_DIR=${1#*=}; shift ;;
        --port) [[ $# -ge 2 ]] || usage; CTLD_PORT=$2; shift 2 ;;
        --port=*) CTLD_PORT=${1#*=}; shift ;;
        --timeout) [[ $# -ge 2 ]] || usage; START_TIMEOUT_S=$2; shift 2 ;;
        --timeout=*) START_TIMEOUT_S=${1#*=}; shift ;;
        -h | --help) usage ;;
        *) log "unknown argument: $1"; usage ;;
    esac
done
case $COMMAND in start | stop | status) ;; *) usage ;; esac
[[ $CTLD_PORT =~ ^[0-9]+$ ]] && ((CTLD_PORT >= 1024 && CTLD_PORT <= 65534)) \
    || die "--port must be an integer in [1024, 65534], got '$CTLD_PORT'"
[[ $START_TIMEOUT_S =~ ^[0-9]+$ ]] && ((START_TIMEOUT_S >= 1)) \
    || die "--timeout must be a positive integer of seconds, got '$START_TIMEOUT_S'"
[[ $STATE_DIR == /* ]] || STATE_DIR=$PWD/$STATE_DIR
STATE_DIR=${STATE_DIR%/}
readonly STATE_DIR CTLD_PORT START_TIMEOUT_S
readonly SLURMD_PORT=$((CTLD_PORT + 1))

readonly SLURM_CONF_FILE=$STATE_DIR/slurm.conf
readonly ENV_FILE=$STATE_DIR/env.sh
readonly MUNGE_DIR=$STATE_DIR/munge
readonly MUNGE_KEY=$MUNGE_DIR/munge.key
readonly MUNGE_SOCKET=$MUNGE_DIR/munge.socket
readonly MUNGE_PID=$MUNGE_DIR/munged.pid
readonly MUNGE_LOG=$MUNGE_DIR/munged.log
readonly CTLD_PID=$STATE_DIR/run/slurmctld.pid
readonly SLURMD_PID=$STATE_DIR/run/slurmd.pid
readonly CTLD_LOG=$STATE_DIR/log/slurmctld.log
readonly SLURMD_LOG=$STATE_DIR/log/slurmd.log
NODE_NAME=$(hostname -s)
readonly NODE_NAME
export SLURM_CONF=$SLURM_CONF_FILE

# The pid a pid file names, if that process is alive and is the named daemon
# (a stale pid file may name a recycled pid).
daemon_pid() {
    local pid_file=$1 name=$2 pid
    [[ -s $pid_file ]] || return 1
    pid=$(<"$pid_file")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm ]] || return 1
    [[ $(<"/proc/$pid/comm") == "$name" ]] || return 1
    printf '%s\n' "$pid"
}

require_root() {
    ((EUID == 0)) \
        || die "must run as root: slurmd starts each job as the user who submitted it (sudo $PROG $COMMAND ...)"
}

ensure_packages() {
    local missing=() cmd
    for cmd in "${REQUIRED_COMMANDS[@]}"; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ -r /etc/debian_version ]] \
        || die "missing ${missing[*]}; install SLURM and munge with your distribution's packages" \
            "(this script installs them only on Debian and Ubuntu)"
    log "installing ${PACKAGES[*]} (missing: ${missing[*]})"
    # Package output goes to stderr: stdout carries only the export line.
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2
}

# max(nproc, 8) CPUs (SlurmdParameters=config_overrides lets the node advertise more than it has):
# a campaign rehearsal runs a TP=4 rl job (4 gloo ranks plus its rollout stand-ins) on this one node,
# oversubscribed on purpose with tiny models, and a two-task srun must fit even on a 1-CPU VM.
node_cpus() {
    local cpus
    cpus=$(nproc)
    ((cpus >= 8)) || cpus=8
    printf '%s\n' "$cpus"
}

# 90% of physical memory, as on a real node: the OS and the daemons keep the rest.
node_memory_mb() {
    awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.9 }' /proc/meminfo
}

render_slurm_conf() {
    cat <<EOF
# Generated by slurm/dev-cluster.sh; rewritten on every start (edits are lost).
ClusterName=winnow-dev
# Bind to loopback only: the controller and node listen on 127.0.0.1, not on
# every interface (CommunicationParameters below), and munge is a Unix socket.
SlurmctldHost=$NODE_NAME(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s); 10 s still
# leaves a loaded laptop ample time to launch a step with its credential.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$CTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: they need systemd delegation that containers and CI runners lack.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
# No mail on a dev machine (the default, /bin/mail, is usually absent).
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/backfill
# Re-test pending jobs (begin times, dependencies) every 5 s instead of 60/30 s
# and schedule a submitted batch job at once instead of batching submissions for
# up to 3 s: one small node, so frequent passes cost nothing and tests wait less.
SchedulerParameters=sched_interval=5,bf_interval=5,batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
# A node that was DOWN for any reason returns as soon as slurmd registers again.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MaxJobCount=10000
# Without accounting storage, finished jobs are visible (scontrol show job,
# squeue -t all) only for MinJobAge seconds after they end.
MinJobAge=600
# Batch jobs may be requeued (scontrol requeue, node failure); a batch script
# exiting 75 (EX_TEMPFAIL, "try again") is requeued automatically.
JobRequeue=1
RequeueExit=75
NodeName=$NODE_NAME NodeHostname=$NODE_NAME NodeAddr=127.0.0.1 CPUs=$(node_cpus) RealMemory=$(node_memory_mb) State=UNKNOWN
PartitionName=dev Nodes=$NODE_NAME Default=YES MaxTime=INFINITE DefaultTime=00:30:00 State=UP
EOF
}

prepare_state_dir() {
    # Every directory on the path must be traversable by the munge user and by
    # job owners, hence 0755 (the munge key itself is 0400).
    install -d -m 0755 "$STATE_DIR" "$STATE_DIR/state" "$STATE_DIR/spool" "$STATE_DIR/run" "$STATE_DIR/log"
    install -d -m 0755 -o munge -g munge "$MUNGE_DIR"
    if [[ ! -s $MUNGE_KEY ]]; then
        log "generating munge key $MUNGE_KEY"
        (umask 0377 && head -c 1024 /dev/urandom >"$MUNGE_KEY.tmp")
        chown munge:munge "$MUNGE_KEY.tmp"
        mv "$MUNGE_KEY.tmp" "$MUNGE_KEY"
    fi
    printf 'export SLURM_CONF=%s\n' "$SLURM_CONF_FILE" >"$ENV_FILE"
    local rendered
    rendered=$(render_slurm_conf)
    if [[ -f $SLURM_CONF_FILE ]] && [[ $(<"$SLURM_CONF_FILE") == "$rendered" ]]; then
        return 0
    fi
    if daemon_pid "$CTLD_PID" slurmctld >/dev/null || daemon_pid "$SLURMD_PID" slurmd >/dev/null; then
        die "$SLURM_CONF_FILE would change while SLURM daemons run from it;" \
            "run '$PROG stop --state-dir $STATE_DIR' first"
    fi
    printf '%s\n' "$rendered" >"$SLURM_CONF_FILE.tmp"
    chmod 0644 "$SLURM_CONF_FILE.tmp"
    mv "$SLURM_CONF_FILE.tmp" "$SLURM_CONF_FILE"
}

show_log_tails() {
    local file
    for file in "$MUNGE_LOG" "$CTLD_LOG" "$SLURMD_LOG"; do
        [[ -f $file ]] || continue
        printf '\n--- last lines of %s ---\n' "$file" >&2
        tail -n 25 "$file" >&2
    done
}

fail_start() {
    log "error: $*"
    show_log_tails
    log "the daemons that did start are still running; '$PROG stop --state-dir $STATE_DIR' stops them"
    exit 1
}

start_munged() {
    if daemon_pid "$MUNGE_PID" munged >/dev/null; then
        return 0
    fi
    rm -f "$MUNGE_PID"
    log "starting munged"
    runuser -u munge -- munged --key-file="$MUNGE_KEY" --socket="$MUNGE_SOCKET" \
        --pid-file="$MUNGE_PID" --log-file="$MUNGE_LOG" --seed-file="$MUNGE_DIR/munged.seed" \
        || fail_start "munged did not start"
    # A credential round trip proves the socket and key work before slurm needs them.
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null \
        || fail_start "munged runs but a munge/unmunge round trip through $MUNGE_SOCKET failed"
}

start_slurm_daemon() {
    local name=$1 pid_file=$2 port=$3
    if daemon_pid "$pid_file" "$name" >/dev/null; then
        return 0
    fi
    rm -f "$pid_file"
    # A connect that succeeds means someone else listens there; the daemon would die.
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        fail_start "port $port on 127.0.0.1 is taken (another SLURM cluster?); pick other ports with --port"
    fi
    log "starting $name"
    "$name" -f "$SLURM_CONF_FILE" || fail_start "$name exited with status $?"
    # The daemonized child writes the pid file after the parent has returned.
    local deadline=$((SECONDS + 10))
    until daemon_pid "$pid_file" "$name" >/dev/null; do
        ((SECONDS < deadline)) || fail_start "$name wrote no pid file to $pid_file within 10 s"
        sleep 0.1
    done
}

wait_for_idle_node() {
    local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
    while ((SECONDS < deadline)); do
        daemon_pid "$CTLD_PID" slurmctld >/dev/null || fail_start "slurmctld died"
        daemon_pid "$SLURMD_PID" slurmd >/dev/null || fail_start "slurmd died"
        state=$(sinfo -h -N -n "$NODE_NAME" -o %T 2>/dev/null || true)
        case $state in
            idle | mixed | allocated) return 0 ;;
            drain* | drained* | fail*)
                fail_start "node $NODE_NAME is $state: $(sinfo -h -N -n "$NODE_NAME" -o %E)" ;;
        esac
        sleep 0.5
    done
    fail_start "node $NODE_NAME not idle after ${START_TIMEOUT_S}s (last state: '${state:-no answer from slurmctld}')"
}

cmd_start() {
    require_root
    ensure_packages
    id munge >/dev/null 2>&1 || die "user 'munge' does not exist; reinstall the munge package"
    prepare_state_dir
    local started=$SECONDS
    start_munged
    start_slurm_daemon slurmctld "$CTLD_PID" "$CTLD_PORT"
    start_slurm_daemon slurmd "$SLURMD_PID" "$SLURMD_PORT"
    wait_for_idle_node
    log "node $NODE_NAME is up (partition dev, $(node_cpus) CPUs) after $((SECONDS - started)) s;" \
        "submit with sbatch/srun once SLURM_CONF is set"
    printf 'export SLURM_CONF=%s\n' "$SLURM_CONF_FILE"
}

stop_daemon() {
    local name=$1 pid_file=$2 pid waited=0
    pid=$(daemon_pid "$pid_file" "$name") || {
        rm -f "$pid_file"
        return 0
    }
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    # slurmctld saves its state on SIGTERM; give it 15 s before SIGKILL.
    while kill -0 "$pid" 2>/dev/null && ((waited < 150)); do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name ignored SIGTERM for 15 s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pid_file"
}

# Cancel every job so that no job processes outlive the daemons; bounded wait.
cancel_all_jobs() {
    local job_ids waited=0
    job_ids=$(squeue -h -o %A 2>/dev/null) || return 0
    [[ -n $job_ids ]] || return 0
    log "cancelling jobs: ${job_ids//$'\n'/ }"
    # shellcheck disable=SC2086  # one argument per job id
    scancel $job_ids 2>/dev/null || true
    while [[ -n $(squeue -h -t running,completing -o %A 2>/dev/null) ]] && ((waited < 300)); do
        sleep 0.1
        waited=$((waited + 1))
    done
}

cmd_stop() {
    require_root
    [[ -d $STATE_DIR ]] || {
        log "no cluster state in $STATE_DIR; nothing to stop"
        return 0
    }
    if ! daemon_pid "$MUNGE_PID" munged >/dev/null && ! daemon_pid "$CTLD_PID" slurmctld >/dev/null \
        && ! daemon_pid "$SLURMD_PID" slurmd >/dev/null; then
        rm -f "$MUNGE_PID" "$CTLD_PID" "$SLURMD_PID"
        log "not running; nothing to stop"
        return 0
    fi
    if daemon_pid "$CTLD_PID" slurmctld >/dev/null && daemon_pid "$SLURMD_PID" slurmd >/dev/null; then
        cancel_all_jobs
    fi
    stop_daemon slurmd "$SLURMD_PID"
    stop_daemon slurmctld "$CTLD_PID"
    stop_daemon munged "$MUNGE_PID"
    log "stopped (state and logs kept in $STATE_DIR)"
}

cmd_status() {
    local down=0 name pid_file pid
    for name in munged slurmctld slurmd; do
        case $name in
            munged) pid_file=$MUNGE_PID ;;
            slurmctld) pid_file=$CTLD_PID ;;
            slurmd) pid_file=$SLURMD_PID ;;
        esac
        if pid=$(daemon_pid "$pid_file" "$name"); then
            printf '%-10s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-10s not running\n' "$name"
            down=1
        fi
    done
    if ((down)); then
        echo "dev cluster in $STATE_DIR is down; start it with: sudo $0 start --state-dir $STATE_DIR"
        exit 1
    fi
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
    sinfo || exit 1
    squeue || exit 1
}

case $COMMAND in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
esac
