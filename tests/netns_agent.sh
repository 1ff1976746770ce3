#!/bin/sh
# tests/netns_agent.sh - Open MPI's plm_rsh_agent for the namespace "nodes" of tests/netns.py:
# called as `netns_agent.sh HOST COMMAND...` in place of ssh, it runs COMMAND (words joined and
# read by a shell, as ssh's remote shell would) in HOST's network namespace with HOST as the
# host name. The table (GEM_NETNS_TABLE, inherited from mpirun) has a line per node:
# "hostname address namespace".
set -eu
host=$1
shift
netns=""
while read -r name addr ns; do
  if [ "$host" = "$name" ] || [ "$host" = "$addr" ]; then
    netns=$ns
    host=$name
  fi
done <"${GEM_NETNS_TABLE:?netns_agent.sh: GEM_NETNS_TABLE is not set}"
if [ -z "$netns" ]; then
  echo "netns_agent.sh: no node $host in $GEM_NETNS_TABLE" >&2
  exit 1
fi
# shellcheck disable=SC2016 # $0 and $* are the inner shell's
exec ip netns exec "$netns" unshare --uts sh -c 'hostname "$0" && eval "$*"' "$host" "$@"
