#!/usr/bin/env bash
# A real Slurm on this one machine, for the tests: Debian's slurm-wlm and munge, one controller
# and several compute nodes (one slurmd each, told apart by port), all on 127.0.0.1.
#
#   launch/slurm/testbed.sh [up]     install if needed, configure, start, wait until idle
#   launch/slurm/testbed.sh status   print the nodes (exit 1 when the controller is down)
#   launch/slurm/testbed.sh down     stop the daemons and remove the testbed's config and state
#
# Safe to run twice: "up" leaves a running testbed with the same config alone. It refuses to
# touch an /etc/slurm/slurm.conf that it did not write (a real cluster's config).
# Several nodes on one host: Debian's slurmd accepts "-N NAME" with a Port per node, so no
# network namespaces are needed (checked with slurm-wlm 22.05.8). Heterogeneous job components
# never share a node, so there are as many nodes as the tests use components (3).
# Environment: SLURM_TESTBED_NODES (3), SLURM_TESTBED_CPUS (16 per node; more than the real
# cores on purpose, so that several tasks fit), SLURM_TESTBED_TIMEOUT (seconds to wait, 120).
set -euo pipefail

NODES=${SLURM_TESTBED_NODES:-3}
CPUS=${SLURM_TESTBED_CPUS:-16}
GPUS=${SLURM_TESTBED_GPUS:-2}
TIMEOUT=${SLURM_TESTBED_TIMEOUT:-120}
CONF=/etc/slurm/slurm.conf
GRES=/etc/slurm/gres.conf
MARK="# rs-pserver Slurm testbed, written by launch/slurm/testbed.sh"
STATE=/var/lib/slurm/testbed
LOGS=/var/log/slurm
RUN=/run/slurm
FIRST_PORT=17001

say() { echo "testbed: $*" >&2; }
die() { say "$*"; exit 1; }

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "sl$i"; done; }

# apt with the dpkg lock possibly held by someone else: wait for it, then retry (bounded).
apt_retry() {
    local try
    for try in 1 2 3 4 5 6; do
        if DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=120 "$@"; then
            return 0
        fi
        say "apt-get $1 failed (try $try of 6); retrying in 10 s"
        sleep 10
    done
    return 1
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get"
    say "installing slurm-wlm and munge"
    apt_retry update
    apt_retry install -y --no-install-recommends slurm-wlm munge
}

write_conf() {
    local host
    host=$(hostname -s)
    cat <<EOF
$MARK
# $NODES nodes on $host, each with $CPUS CPUs declared (config_overrides: more than the real
# cores, so that a server and several workers fit on a small machine).
ClusterName=rstestbed
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
# A requeued job waits until its old credential has expired (default 120 s); 20 s here.
AuthInfo=cred_expire=20
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Heterogeneous jobs are started by the backfill scheduler only: run it every 2 s.
SchedulerParameters=bf_interval=2
ReturnToService=2
KillWait=30
# Finished jobs stay visible for 16 s: long enough for pollers, and 'sbatch --wait' (which
# backs off to MinJobAge/2) then asks every 8 s instead of every 32 s.
MinJobAge=16
MessageTimeout=20
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
EOF
    echo "# The last node has $GPUS stand-in GPUs (gres.conf): no GPU computes here, but Slurm"
    echo "# hands them out and sets CUDA_VISIBLE_DEVICES as it would for real ones."
    echo "GresTypes=gpu"
    local i gres
    for ((i = 1; i <= NODES; i++)); do
        gres=""
        ((i == NODES && GPUS > 0)) && gres=" Gres=gpu:$GPUS"
        echo "NodeName=sl$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((FIRST_PORT + i - 1))" \
            "CPUs=$CPUS RealMemory=4000$gres State=UNKNOWN"
    done
    echo "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
}

# gres.conf: the stand-in GPU "devices" are character devices like /dev/null (Slurm only looks
# at their numbers; nothing constrains device access here).
write_gres() {
    echo "$MARK"
    if ((GPUS > 0)); then
        echo "NodeName=sl$NODES Name=gpu File=$STATE/gpu[0-$((GPUS - 1))]"
    fi
}

ours() { [[ -f $CONF ]] && head -n 1 "$CONF" | grep -qxF "$MARK"; }

ctld_up() { timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        say "creating /etc/munge/munge.key"
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    local deadline=$((SECONDS + 20))
    until munge -n 2>/dev/null | unmunge >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "munged did not start"
        sleep 0.5
    done
}

stop_daemons() {
    if ctld_up; then
        timeout 20 scontrol shutdown >/dev/null 2>&1 || true
    fi
    local pidfile pid
    for pidfile in "$RUN"/slurmctld.pid "$RUN"/slurmd-sl*.pid; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            timeout 20 tail --pid="$pid" -f /dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

start_daemons() {
    install -d -m 0755 "$STATE/ctld" "$LOGS" "$RUN"
    local name
    if ! pid_alive "$RUN/slurmctld.pid"; then
        slurmctld
    fi
    for name in $(node_names); do
        install -d -m 0755 "$STATE/$name"
        if ! pid_alive "$RUN/slurmd-$name.pid"; then
            slurmd -N "$name"
        fi
    done
}

wait_idle() {
    local deadline=$((SECONDS + TIMEOUT)) states
    while true; do
        if ctld_up; then
            states=$(sinfo -h -N -o "%t" 2>/dev/null | sort -u | tr '\n' ' ')
            # idle, or busy with jobs (mix/alloc): every node answers.
            if [[ -n $states && -z $(echo "$states" | tr ' ' '\n' | grep -vxE 'idle|mix|alloc|') ]]
            then
                say "up: $(sinfo -h -N -o '%N:%t' | tr '\n' ' ')"
                return 0
            fi
            # Nodes left down by an earlier run come back once they answer.
            if echo "$states" | grep -qE 'down|drain'; then
                scontrol update nodename="sl[1-$NODES]" state=resume >/dev/null 2>&1 || true
            fi
        fi
        if ((SECONDS >= deadline)); then
            sinfo -N >&2 || true
            tail -n 20 "$LOGS/slurmctld.log" >&2 || true
            die "the nodes were not idle within $TIMEOUT s (logs in $LOGS)"
        fi
        sleep 1
    done
}

up() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and starts daemons)"
    install_packages
    if [[ -f $CONF ]] && ! ours; then
        die "$CONF exists and was not written by this script; not touching a real cluster's config"
    fi
    local wanted gres i
    wanted=$(write_conf)
    gres=$(write_gres)
    if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$wanted" ]] \
        || [[ ! -f $GRES ]] || [[ $(cat "$GRES") != "$gres" ]]; then
        say "writing $CONF and $GRES"
        stop_daemons
        install -d -m 0755 /etc/slurm
        printf '%s\n' "$wanted" >"$CONF"
        printf '%s\n' "$gres" >"$GRES"
    fi
    install -d -m 0755 "$STATE"
    for ((i = 0; i < GPUS; i++)); do
        [[ -c $STATE/gpu$i ]] || { rm -f "$STATE/gpu$i"; mknod -m 0666 "$STATE/gpu$i" c 1 3; }
    done
    start_munge
    start_daemons
    wait_idle
}

down() {
    if [[ -f $CONF ]] && ! ours; then
        die "$CONF was not written by this script; not stopping a real cluster"
    fi
    stop_daemons
    if [[ -f /run/munge/munged.pid ]]; then
        kill -TERM "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    fi
    rm -rf "$STATE"
    rm -f "$CONF" "$GRES"
    say "down"
}

status() {
    ctld_up || die "the controller is not running"
    sinfo -N
}

case ${1:-up} in
    up) up ;;
    down) down ;;
    status) status ;;
    *) die "usage: $0 [up|down|status]" ;;
esac
