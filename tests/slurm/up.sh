#!/usr/bin/env bash
# Stand up a single-host Slurm 22.05 (Debian packages) with two emulated nodes
# n1, n2 (Debian builds slurmd with MULTIPLE_SLURMD: `slurmd -N n1`), slurmdbd
# on a private MariaDB, and munge. No systemd; every daemon is started here by
# hand and its PID kept under $DISTDIAG_SLURM_DIR/run, so down.sh stops exactly
# these processes.
#
# Re-running it while the daemons run is fine: a daemon whose PID file points at
# a live process of the same name is left alone. Everything (config, state,
# spool, logs, database) lives under one directory:
#   DISTDIAG_SLURM_DIR   default /tmp/distdiag-slurm
#   $DIR/etc/env.sh      `source` it for SLURM_CONF (tests read it from there)
#   $DIR/run/started.pids  PIDs this invocation started (down.sh --started)
#
# Why each setting (measured on 2-core Debian 12 machines):
#   CPUs=8 + SlurmdParameters=config_overrides: 8 tasks per node on 2 cores;
#     asking for more tasks than declared CPUs pends forever.
#   ProctrackType=linuxproc, TaskPlugin=task/none: no cgroups/systemd needed.
#   MpiDefault=pmi2: the PyPI mpich wheel's ranks (PMI-1 only, no PMIx) find
#     each other under plain srun. The plugin misreads PMI-1 lines over 1024
#     bytes, so the tests start the wheel through its Hydra (SlurmCluster.srun_mpi
#     in tests/conftest.py; README, "MPI under srun"). --mpi=pmix cannot start
#     the wheel, and here fails sooner: both slurmd "nodes" make the same
#     /tmp/spmix_appdir_<uid>_<job>.<step> ("File exists").
#   MailProg=/bin/true: no MTA here.
#   Private MariaDB started with --skip-grant-tables, bound to 127.0.0.1 only:
#     a throwaway accounting store for tests, no user management to get wrong.
set -euo pipefail

DIR=${DISTDIAG_SLURM_DIR:-/tmp/distdiag-slurm}
HOST=$(hostname -s)
CLUSTER=distdiag
CTLD_PORT=${DISTDIAG_SLURM_CTLD_PORT:-17817}
DBD_PORT=${DISTDIAG_SLURM_DBD_PORT:-17819}
DB_PORT=${DISTDIAG_SLURM_DB_PORT:-17306}
NODE_PORTS=(17001 17002)
NODES=(n1 n2)
CPUS_PER_NODE=${DISTDIAG_SLURM_CPUS:-8}
T0=$SECONDS

log() { echo "[slurm up $((SECONDS - T0))s] $*"; }
die() { echo "[slurm up] ERROR: $*" >&2; exit 1; }

for b in slurmctld slurmd slurmdbd munged mariadbd mariadb-install-db sacct srun; do
    command -v "$b" >/dev/null || die "$b not found (apt-get install --no-install-recommends slurmctld slurmd slurm-client slurmdbd munge mariadb-server libpmix-dev)"
done

mkdir -p "$DIR"/{etc,run,log,state,mysql} "$DIR"/spool/{n1,n2}
chmod 755 "$DIR"
mkdir -p "$DIR/munge"
chown munge:munge "$DIR/munge"
chmod 755 "$DIR/munge"  # munged wants the socket dir executable by all
: >"$DIR/run/started.pids"

# alive NAME PIDFILE: the PID file names a live process whose command is NAME.
alive() {
    local pid
    [[ -s $2 ]] || return 1
    pid=$(tr -dc 0-9 <"$2")
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$1"
}
started() { tr -dc 0-9 <"$1" >>"$DIR/run/started.pids"; echo >>"$DIR/run/started.pids"; }
# wait_for WHAT SECONDS CMD...: poll CMD every 0.2 s.
wait_for() {
    local what=$1 n=$(($2 * 5)); shift 2
    while ((n-- > 0)); do
        if [[ $(type -t "$1") == function ]]; then
            if "$@" >/dev/null 2>&1; then return 0; fi
        elif timeout 5 "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    die "$what did not come up; see $DIR/log/"
}

# --- config --------------------------------------------------------------
# The default socket: sacct/sacctmgr ignore AuthInfo for slurmdbd connections
# in 22.05, so a private socket would break them.
MUNGE_SOCK=/run/munge/munge.socket.2
cat >"$DIR/etc/slurm.conf.new" <<CONF
# Written by tests/slurm/up.sh; see the comments there.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
MpiDefault=pmi2
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=${NODES[0]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=$CPUS_PER_NODE State=UNKNOWN
NodeName=${NODES[1]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=$CPUS_PER_NODE State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
CONF
mv "$DIR/etc/slurm.conf.new" "$DIR/etc/slurm.conf"

cat >"$DIR/etc/slurmdbd.conf" <<CONF
# Written by tests/slurm/up.sh
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=root
StorageLoc=slurm_acct_db
CONF
chmod 600 "$DIR/etc/slurmdbd.conf"

cat >"$DIR/etc/env.sh" <<CONF
# source this to use the test Slurm (written by tests/slurm/up.sh)
export DISTDIAG_SLURM_DIR=$DIR
export SLURM_CONF=$DIR/etc/slurm.conf
CONF
export SLURM_CONF=$DIR/etc/slurm.conf
# Let plain `srun`/`sacct` (launchers/, people at a shell) find this cluster
# too, unless the machine has a Slurm config of its own.
if [[ ! -e /etc/slurm/slurm.conf || -L /etc/slurm/slurm.conf ]]; then
    mkdir -p /etc/slurm && ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf
fi

# --- munge ----------------------------------------------------------------
if alive munged "$DIR/run/munged.pid"; then
    log "munged already running"
elif [[ -S $MUNGE_SOCK ]] && timeout 5 munge -n -s "$MUNGE_SOCK" >/dev/null 2>&1; then
    log "using the munged already serving $MUNGE_SOCK (not ours: down.sh leaves it)"
else
    [[ -s /etc/munge/munge.key ]] || { /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null || create-munge-key -f; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    # munged runs as user munge and refuses files it does not own.
    runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCK" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed" --key-file=/etc/munge/munge.key
    wait_for munged 10 test -S "$MUNGE_SOCK"
    wait_for munged-pid 5 test -s "$DIR/munge/munged.pid"
    cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"
    started "$DIR/run/munged.pid"
    log "munged up"
fi

# --- MariaDB ----------------------------------------------------------------
DB_SOCK=$DIR/run/mysqld.sock
if alive mariadbd "$DIR/run/mariadbd.pid"; then
    log "mariadbd already running"
else
    if [[ ! -d $DIR/mysql/mysql ]]; then
        mariadb-install-db --user=root --datadir="$DIR/mysql" --skip-test-db \
            --auth-root-authentication-method=normal >"$DIR/log/mariadb-install.log" 2>&1 \
            || die "mariadb-install-db failed; see $DIR/log/mariadb-install.log"
    fi
    # setsid: mariadbd does not daemonize; keep it out of our process group.
    setsid /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DIR/mysql" \
        --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 \
        --pid-file="$DIR/run/mariadbd.pid" --log-error="$DIR/log/mariadb.log" \
        --skip-grant-tables --innodb-buffer-pool-size=64M --innodb-log-file-size=16M \
        --skip-log-bin </dev/null >/dev/null 2>&1 &
    wait_for mariadbd 30 mariadb-admin --no-defaults --socket="$DB_SOCK" ping
    wait_for mariadbd-pid 5 test -s "$DIR/run/mariadbd.pid"
    started "$DIR/run/mariadbd.pid"
    log "mariadbd up"
fi

# --- slurmdbd, slurmctld, slurmd ---------------------------------------------
if alive slurmdbd "$DIR/run/slurmdbd.pid"; then
    log "slurmdbd already running"
else
    SLURM_CONF=$DIR/etc/slurm.conf slurmdbd
    wait_for slurmdbd-pid 10 test -s "$DIR/run/slurmdbd.pid"
    started "$DIR/run/slurmdbd.pid"
    # Ready once it answers the accounting protocol.
    wait_for slurmdbd 30 sacctmgr -n list cluster
    log "slurmdbd up"
fi
if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

if alive slurmctld "$DIR/run/slurmctld.pid"; then
    log "slurmctld already running"
else
    # No -c: keep the job-id counter across restarts, so ids never repeat in
    # the accounting database that outlives the controller.
    slurmctld
    wait_for slurmctld-pid 10 test -s "$DIR/run/slurmctld.pid"
    started "$DIR/run/slurmctld.pid"
    wait_for slurmctld 30 scontrol ping
    log "slurmctld up"
fi

for n in "${NODES[@]}"; do
    if alive slurmd "$DIR/run/slurmd-$n.pid"; then
        log "slurmd $n already running"
    else
        slurmd -N "$n"
        wait_for "slurmd-$n-pid" 10 test -s "$DIR/run/slurmd-$n.pid"
        started "$DIR/run/slurmd-$n.pid"
    fi
done

nodes_idle() {
    local s
    s=$(timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    [[ $(grep -cE ' (idle|mix|alloc)$' <<<"$s") == "${#NODES[@]}" ]]
}
wait_for "nodes idle" 30 nodes_idle
log "Slurm up: $(sinfo -h -N -o '%N/%t/%c' | tr '\n' ' ')(SLURM_CONF=$SLURM_CONF)"
