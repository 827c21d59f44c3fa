#!/usr/bin/env bash
# A real Slurm cluster of N nodes on this one machine, to run launch/slurm/train.sbatch across
# "nodes" without a cluster: munged, slurmctld and one `slurmd -N nX` per node, each node with its
# own port and NodeHostname = this host, node names resolvable through /etc/hosts.
#
#   launch/slurm/local_cluster.sh up [--nodes 2] [--dir DIR] [--port 6817]
#   export SLURM_CONF=DIR/slurm.conf       # printed by `up`; /etc/slurm/slurm.conf points there when free
#   sbatch -N 2 --wrap 'srun hostname'
#   launch/slurm/local_cluster.sh status
#   launch/slurm/local_cluster.sh down      # stops the daemons, removes DIR and the /etc/hosts entries
#
# Needs root (it runs the daemons, edits /etc/hosts and may apt-get install slurm-wlm and munge).
# Everything it writes lives in DIR (default /var/lib/switchyard-slurm), apart from the tagged
# /etc/hosts line and the /etc/slurm/slurm.conf link, which `down` removes again.
set -euo pipefail

TAG="# switchyard-local-slurm"
cmd="${1:-}"
[ $# -gt 0 ] && shift
nodes=2
dir="${SWITCHYARD_SLURM_DIR:-/var/lib/switchyard-slurm}"
ctld_port=6817
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes="${2:?--nodes needs a number}"; shift 2 ;;
    --nodes=*) nodes="${1#*=}"; shift ;;
    --dir) dir="${2:?--dir needs a path}"; shift 2 ;;
    --dir=*) dir="${1#*=}"; shift ;;
    --port) ctld_port="${2:?--port needs a number}"; shift 2 ;;
    --port=*) ctld_port="${1#*=}"; shift ;;
    *) echo "local_cluster.sh: unknown argument '$1'" >&2; cmd=help; break ;;
  esac
done

case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac  # the daemons need absolute paths

say() { echo "local_cluster: $*" >&2; }
die() { echo "local_cluster: error: $*" >&2; exit 1; }

conf="$dir/slurm.conf"
munge_sock="$dir/munge/munge.socket"
export SLURM_CONF="$conf"

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

log_tail() {  # the end of a daemon's log, for error messages
  [ -f "$1" ] && { echo "--- $1 (last lines)" >&2; tail -n 15 "$1" >&2; }
  return 0
}

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (it starts slurmctld/slurmd/munged and edits /etc/hosts); use sudo"
}

install_packages() {
  local missing=()
  for b in slurmctld slurmd sbatch srun sinfo munged munge; do
    command -v "$b" >/dev/null 2>&1 || missing+=("$b")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and there is no apt-get; install Slurm (slurm-wlm) and MUNGE with this system's package manager"
  say "installing slurm-wlm and munge with apt-get (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  local pkgs=(slurm-wlm munge)
  if ! apt-get install -y -q --no-install-recommends "${pkgs[@]}" >"/tmp/switchyard-slurm-apt.log" 2>&1; then
    apt-get update -q >>"/tmp/switchyard-slurm-apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >>"/tmp/switchyard-slurm-apt.log" 2>&1 \
      || { tail -n 20 /tmp/switchyard-slurm-apt.log >&2; die "apt-get install ${pkgs[*]} failed (log: /tmp/switchyard-slurm-apt.log); check the package sources or install them yourself"; }
  fi
  for b in slurmctld slurmd sbatch munged; do
    command -v "$b" >/dev/null 2>&1 || die "apt-get installed slurm-wlm and munge but '$b' is still not on PATH"
  done
}

this_host() { hostname -s; }

host_addr() {  # the address this host's name resolves to; node names get the same one
  getent ahostsv4 "$(this_host)" 2>/dev/null | awk '{print $1; exit}' | grep . || echo 127.0.0.1
}

node_names() { local i out=""; for ((i = 1; i <= nodes; i++)); do out+="${out:+ }n$i"; done; echo "$out"; }

hosts_remove() {  # rewrite in place: /etc/hosts is often a bind mount that cannot be replaced
  [ -w /etc/hosts ] || return 0
  if grep -qF "$TAG" /etc/hosts; then
    local kept
    kept="$(grep -vF "$TAG" /etc/hosts || true)"
    printf '%s\n' "$kept" >/etc/hosts
  fi
}

hosts_add() {
  hosts_remove
  local line
  line="$(host_addr) $(node_names) $TAG"
  echo "$line" >>/etc/hosts || die "cannot write /etc/hosts; add '$line' to it so the node names resolve"
}

write_conf() {
  local cpus host i
  cpus=$(( $(nproc) / nodes )); [ "$cpus" -ge 1 ] || cpus=1
  host="$(this_host)"
  cat >"$conf" <<EOF
# written by launch/slurm/local_cluster.sh: $nodes Slurm nodes on one host ($host)
ClusterName=switchyard
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_sock
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=900
SlurmdTimeout=120
InactiveLimit=0
KillWait=10
EOF
  for ((i = 1; i <= nodes; i++)); do
    echo "NodeName=n$i NodeHostname=$host Port=$((ctld_port + i)) CPUs=$cpus State=UNKNOWN" >>"$conf"
  done
  echo "PartitionName=local Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP" >>"$conf"
}

start_munge() {
  mkdir -p "$dir/munge"
  chmod 700 "$dir/munge"
  local key="$dir/munge/munge.key"
  if [ ! -s "$key" ]; then
    say "creating a munge key in $key"
    dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
  fi
  chmod 400 "$key"
  munged --force --key-file="$key" --socket="$munge_sock" --pid-file="$dir/run/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
    || { log_tail "$dir/log/munged.log"; die "munged did not start (log above)"; }
  munge -S "$munge_sock" -n | unmunge -S "$munge_sock" >/dev/null \
    || { log_tail "$dir/log/munged.log"; die "munged runs but a munge/unmunge round trip through $munge_sock failed"; }
}

wait_idle() {
  local deadline=$((SECONDS + 60)) states
  while :; do
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)"
    if [ -n "$states" ] && [ "$(echo "$states" | grep -c ' idle$')" -eq "$nodes" ]; then
      return 0
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "$states" >&2
      sinfo -R >&2 || true
      log_tail "$dir/log/slurmctld.log"
      for n in $(node_names); do log_tail "$dir/log/slurmd-$n.log"; done
      die "the $nodes nodes did not all become idle within 60 s (states and logs above); run '$0 down' and retry"
    fi
    sleep 1
  done
}

up() {
  need_root
  [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, not '$nodes'"
  install_packages
  slurmd -h 2>&1 | grep -q -- '-N' \
    || die "this slurmd cannot run several daemons on one host (built without --enable-multiple-slurmd)"
  if [ -f "$dir/.switchyard-local-slurm" ]; then
    say "a local cluster was set up in $dir before; taking it down first"
    down
  elif [ -d "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    die "$dir exists and is not empty; pass --dir with a new or empty directory (down deletes it)"
  fi
  mkdir -p "$dir"/{ctld,spool,run,log}
  touch "$dir/.switchyard-local-slurm"
  hosts_add
  write_conf
  start_munge
  slurmctld -c || { log_tail "$dir/log/slurmctld.log"; die "slurmctld did not start (log above)"; }
  local n
  for n in $(node_names); do
    slurmd -N "$n" || { log_tail "$dir/log/slurmd-$n.log"; die "slurmd -N $n did not start (log above); is port $(grep "^NodeName=$n " "$conf" | sed 's/.*Port=\([0-9]*\).*/\1/') free?"; }
  done
  wait_idle
  if [ ! -e /etc/slurm/slurm.conf ] && mkdir -p /etc/slurm 2>/dev/null; then
    ln -s "$conf" /etc/slurm/slurm.conf
  fi
  sinfo -N >&2
  say "up: $nodes node(s) ($(node_names)) on $(this_host); for sbatch/srun/sinfo: export SLURM_CONF=$conf"
}

stop_pidfile() {  # TERM, wait up to 15 s, then KILL
  local f="$1" pid i
  [ -f "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

down() {
  need_root
  if [ -f "$conf" ] && alive "$dir/run/slurmctld.pid"; then
    scancel --quiet --partition=local 2>/dev/null || true  # running jobs go first
    sleep 1
  fi
  local f
  for f in "$dir"/run/slurmd-*.pid; do stop_pidfile "$f"; done
  stop_pidfile "$dir/run/slurmctld.pid"
  stop_pidfile "$dir/run/munged.pid"
  hosts_remove
  if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$conf" ]; then
    rm -f /etc/slurm/slurm.conf
  fi
  if [ -f "$dir/.switchyard-local-slurm" ]; then
    rm -rf "$dir"
  fi
  say "down: daemons stopped; $dir and the /etc/hosts entries removed (slurm-wlm and munge stay installed)"
}

status() {
  local ok=0 f
  if [ ! -f "$conf" ]; then
    say "no local cluster in $dir (run '$0 up')"
    return 1
  fi
  for f in "$dir/run/munged.pid" "$dir/run/slurmctld.pid" "$dir"/run/slurmd-*.pid; do
    if alive "$f"; then say "$(basename "$f" .pid): running (pid $(cat "$f"))"
    else say "$(basename "$f" .pid): NOT running"; ok=1; fi
  done
  sinfo -N >&2 || ok=1
  say "SLURM_CONF=$conf"
  return $ok
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) usage ;;
esac
