#!/bin/bash
# A SLURM cluster on this machine, for testing recipes/slurm/train.sbatch for real: Debian's
# slurmctld + slurmd + munge (apt-get install slurmctld slurmd munge slurm-client), run as root,
# everything (config, munge key and socket, state, logs) under one directory.
#
#   recipes/slurm/local_cluster.sh up   [DIR]   write DIR/slurm.conf, start munged, slurmctld, the slurmd(s)
#   recipes/slurm/local_cluster.sh down [DIR]   cancel its jobs, stop the daemons (and remove the nodes' network)
#   recipes/slurm/local_cluster.sh env  [DIR]   print `export SLURM_CONF=...` (for sbatch, squeue, scancel)
#   recipes/slurm/local_cluster.sh exec [DIR] NODE CMD...   run CMD on NODE (in its namespaces; NODES>=2)
#
# NODES=1 (the default): one node, this host, on 127.0.0.1.
# NODES=N>=2: N nodes, each a Linux network namespace with its own UTS namespace (hostname
#   ${NODE_PREFIX}1..N), mount namespace (its own /etc/hosts, and DIR/nodes/NAME seen as DIR/node:
#   the node's local disk for slurmd's spool, pid file and log) and one slurmd. Every namespace has
#   one interface, ${SLURM_IFNAME} (a veth whose other end is on the bridge ${SLURM_TAG}br0 in the
#   host's namespace), with address ${SLURM_NET}.(10+i)/24; the bridge has ${SLURM_NET}.1, where
#   slurmctld and munged (host namespace) are reached. No route leads anywhere else: no traffic
#   leaves the machine. Jobs on a node run in its namespaces, so ranks on two nodes talk over the
#   veth pairs and the bridge, and their hostnames differ, as on two hosts.
#
# Knobs (environment): SLURM_PORT (6917; slurmctld's port, slurmd takes the next one),
# SLURM_NET (10.233.0), SLURM_TAG (hr: names of the bridge, the namespaces and the veths),
# SLURM_IFNAME (hrnet0), NODE_PREFIX (hrnode), SLURMD_TIMEOUT (60: seconds before a silent node
# is DOWN). `make slurm-up [NODES=2]` / `make slurm-down` / `make test-slurm[-2node]` wrap this.
set -euo pipefail

cmd=${1:?usage: local_cluster.sh up|down|env|exec [DIR] ...}
dir=$(realpath -m "${2:-/tmp/hybridrl-slurm}")
port=${SLURM_PORT:-6917}
nodes=${NODES:-1}
net=${SLURM_NET:-10.233.0}
tag=${SLURM_TAG:-hr}
ifname=${SLURM_IFNAME:-hrnet0}
prefix=${NODE_PREFIX:-hrnode}
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

node_names() {     # the nodes of the cluster in DIR (from its saved layout)
    [ -f "$dir/nodes.list" ] && cut -d' ' -f1 "$dir/nodes.list"
}

start_node() {     # start_node NAME ADDR: its namespaces, its interface, its slurmd
    local name=$1 addr=$2 ns="$tag-$1" veth="${tag}v${1#"$prefix"}"
    mkdir -p "$dir/nodes/$name/spool" "$dir/node"
    ip netns add "$ns"
    ip link add "$veth" type veth peer name "$ifname" netns "$ns"
    ip link set "$veth" master "${tag}br0"
    ip link set "$veth" up
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip addr add "$addr/24" dev "$ifname"
    ip netns exec "$ns" ip link set "$ifname" up
    # slurmd daemonizes inside the node's namespaces; the jobs it starts inherit them. (nsenter, not
    # `ip netns exec`, which remounts /sys and so hides the cgroup mounts slurmd reads.)
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
        'hostname "$1" && mount --bind "$2/hosts" /etc/hosts && mount --bind "$2/nodes/$1" "$2/node" &&
         exec slurmd -f "$3" -N "$1"' sh "$name" "$dir" "$conf"
}

wait_idle() {      # until every node is idle (or mixed/allocated)
    local states
    for _ in $(seq 600); do
        states=$(sinfo -h -N -o %T 2>/dev/null | tr '\n' ' ' || true)
        if [ "$(echo "$states" | tr ' ' '\n' | grep -cE '^(idle|mixed|allocated)$')" -ge "$nodes" ]; then
            echo "local_cluster: up ($conf, $nodes node(s): $(sinfo -h -N -o '%N %T' | tr '\n' ' '))"
            return 0
        fi
        sleep 0.1
    done
    echo "local_cluster: the nodes did not come up (states '${states:-?}'); see $dir/slurmctld.log and the slurmd logs" >&2
    return 1
}

case "$cmd" in
env)
    echo "export SLURM_CONF=$conf"
    ;;
exec)
    node=${3:?usage: local_cluster.sh exec DIR NODE CMD...}
    shift 3
    pid=$(cat "$dir/nodes/$node/slurmd.pid")
    exec nsenter -t "$pid" -n -u -m -- "$@"
    ;;
up)
    for bin in slurmctld slurmd munged sbatch; do
        command -v "$bin" >/dev/null || { echo "local_cluster: $bin not found (apt-get install slurmctld slurmd munge slurm-client)" >&2; exit 2; }
    done
    [ "$(id -u)" = 0 ] || { echo "local_cluster: run as root (slurmd starts jobs as their user)" >&2; exit 2; }
    if [ "$nodes" -gt 1 ]; then
        for bin in ip unshare nsenter; do
            command -v "$bin" >/dev/null || { echo "local_cluster: NODES=$nodes needs $bin (iproute2, util-linux)" >&2; exit 2; }
        done
    fi
    "$0" down "$dir" >/dev/null 2>&1 || true
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 700 "$dir/munge"
    [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
    host=$(hostname -s)
    # the node as slurmd sees it (CPUs, sockets, cores, memory), so it is not drained for a mismatch
    spec=$(slurmd -C | head -n 1 | sed -e 's/^NodeName=[^ ]* //')
    if [ "$nodes" -gt 1 ]; then
        ctl_addr="$net.1"
        : > "$dir/nodes.list"
        printf '127.0.0.1 localhost\n%s %s\n' "$ctl_addr" "$host" > "$dir/hosts"
        for i in $(seq "$nodes"); do
            echo "$prefix$i $net.$((10 + i))" >> "$dir/nodes.list"
            echo "$net.$((10 + i)) $prefix$i" >> "$dir/hosts"
        done
        node_lines=$(while read -r name addr; do echo "NodeName=$name NodeAddr=$addr $spec State=UNKNOWN"; done < "$dir/nodes.list")
        slurmd_paths="SlurmdSpoolDir=$dir/node/spool
SlurmdPidFile=$dir/node/slurmd.pid
SlurmdLogFile=$dir/node/slurmd.log"
    else
        ctl_addr=127.0.0.1
        node_lines="NodeName=$host NodeAddr=127.0.0.1 $spec State=UNKNOWN"
        slurmd_paths="SlurmdSpoolDir=$dir/spool
SlurmdPidFile=$dir/slurmd.pid
SlurmdLogFile=$dir/slurmd.log"
    fi
    cat > "$conf" <<EOF
# Written by recipes/slurm/local_cluster.sh: a $nodes-node cluster for tests. Do not use in production.
ClusterName=hybridrl-local
SlurmctldHost=$host($ctl_addr)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
$slurmd_paths
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/slurmctld.log
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
JobRequeue=0
MinJobAge=3600
KillWait=15
SlurmdTimeout=${SLURMD_TIMEOUT:-60}
$node_lines
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    if [ "$nodes" -gt 1 ]; then
        ip link add "${tag}br0" type bridge
        ip addr add "$ctl_addr/24" dev "${tag}br0"
        ip link set "${tag}br0" up
    fi
    slurmctld -f "$conf"
    if [ "$nodes" -gt 1 ]; then
        while read -r name addr; do start_node "$name" "$addr"; done < "$dir/nodes.list"
    else
        slurmd -f "$conf" -N "$host"
    fi
    wait_idle
    ;;
down)
    if [ -f "$conf" ] && [ -f "$dir/slurmctld.pid" ]; then
        scancel --full --signal=KILL --partition=local >/dev/null 2>&1 || true
    fi
    for name in $(node_names); do
        stop_pidfile "$dir/nodes/$name/slurmd.pid"
        if ip netns list | grep -qw "$tag-$name"; then
            for pid in $(ip netns pids "$tag-$name"); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$tag-$name"
        fi
    done
    ip link del "${tag}br0" 2>/dev/null || true
    rm -f "$dir/nodes.list"
    stop_pidfile "$dir/slurmd.pid"
    stop_pidfile "$dir/slurmctld.pid"
    stop_pidfile "$dir/munge/munged.pid"
    echo "local_cluster: down ($dir)"
    ;;
*)
    echo "usage: local_cluster.sh up|down|env|exec [DIR] ..." >&2
    exit 2
    ;;
esac
