#!/bin/bash
# A single-node SLURM cluster on this machine, for testing recipes/slurm/train.sbatch for real:
# Debian's slurmctld + slurmd + munge (apt-get install slurmctld slurmd munge slurm-client), run
# as root, everything (config, munge key and socket, state, logs) under one directory.
#
#   recipes/slurm/local_cluster.sh up   [DIR]   write DIR/slurm.conf, start munged, slurmctld, slurmd
#   recipes/slurm/local_cluster.sh down [DIR]   cancel its jobs, stop the daemons
#   recipes/slurm/local_cluster.sh env  [DIR]   print `export SLURM_CONF=...` (for sbatch, squeue, scancel)
#
# DIR defaults to /tmp/hybridrl-slurm; SLURM_PORT (default 6917) is slurmctld's port, slurmd takes
# the next one. `make slurm-up` / `make slurm-down` / `make test-slurm` wrap this.
set -euo pipefail

cmd=${1:?usage: local_cluster.sh up|down|env [DIR]}
dir=$(realpath -m "${2:-/tmp/hybridrl-slurm}")
port=${SLURM_PORT:-6917}
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

stop_pidfile() {   # stop_pidfile FILE: SIGTERM the daemon it names, wait up to 10 s, then SIGKILL
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

case "$cmd" in
env)
    echo "export SLURM_CONF=$conf"
    ;;
up)
    for bin in slurmctld slurmd munged sbatch; do
        command -v "$bin" >/dev/null || { echo "local_cluster: $bin not found (apt-get install slurmctld slurmd munge slurm-client)" >&2; exit 2; }
    done
    [ "$(id -u)" = 0 ] || { echo "local_cluster: run as root (slurmd starts jobs as their user)" >&2; exit 2; }
    "$0" down "$dir" >/dev/null 2>&1 || true
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 700 "$dir/munge"
    [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
    host=$(hostname -s)
    # the node as slurmd sees it (CPUs, sockets, cores, memory), so it is not drained for a mismatch
    node=$(slurmd -C | head -n 1 | sed -e 's/^NodeName=[^ ]* //')
    cat > "$conf" <<EOF
# Written by recipes/slurm/local_cluster.sh: a one-node cluster for tests. Do not use in production.
ClusterName=hybridrl-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=3600
KillWait=15
SlurmdTimeout=60
NodeName=$host NodeAddr=127.0.0.1 $node State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    slurmctld -f "$conf"
    slurmd -f "$conf" -N "$host"
    for _ in $(seq 300); do
        state=$(sinfo -h -o %T 2>/dev/null | head -n 1 || true)
        case "$state" in idle|mixed|allocated) echo "local_cluster: up ($conf, node $host $state)"; exit 0 ;; esac
        sleep 0.1
    done
    echo "local_cluster: the node did not come up (state '${state:-?}'); see $dir/slurmctld.log and $dir/slurmd.log" >&2
    exit 1
    ;;
down)
    if [ -f "$conf" ] && [ -f "$dir/slurmctld.pid" ]; then
        scancel --full --signal=KILL --partition=local >/dev/null 2>&1 || true
    fi
    stop_pidfile "$dir/slurmd.pid"
    stop_pidfile "$dir/slurmctld.pid"
    stop_pidfile "$dir/munge/munged.pid"
    echo "local_cluster: down ($dir)"
    ;;
*)
    echo "usage: local_cluster.sh up|down|env [DIR]" >&2
    exit 2
    ;;
esac
