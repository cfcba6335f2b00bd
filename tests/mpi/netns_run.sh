#!/usr/bin/env bash
# Two "hosts" on one machine: two Linux network namespaces joined by a veth
# pair, made here, and test_mpi run across them by mpirun over TCP on the
# veth addresses, as between two machines. OpenMPI starts the remote rank's daemon through
# its rsh launcher; the launcher here is `ip netns exec` instead of ssh.
#
# On two real machines the same run is:
#   mpirun -np 2 --host hostA,hostB --mca btl tcp,self \
#          --mca btl_tcp_if_include <subnet> --mca oob_tcp_if_include <subnet> \
#          build/tests/test_mpi 2
# with passwordless ssh between them and the same build path on both.
#
#   netns_run.sh TEST_MPI [VOCAB_SHARDS]   exit 0: pass; 77: skipped (printed why)
set -uo pipefail
prog="$1"
vs="${2:-2}"
skip() { echo "netns_run: SKIPPED: $*"; exit 77; }

[ "$(id -u)" -eq 0 ] || skip "needs root to make network namespaces"
command -v ip >/dev/null || skip "no ip (iproute2)"
command -v mpirun >/dev/null || skip "no mpirun"
tag="fg$$"
nsa="${tag}a" nsb="${tag}b"
ip netns add "$nsa" 2>/dev/null || skip "cannot make a network namespace here (no CAP_SYS_ADMIN?)"
cleanup() { ip netns del "$nsa" 2>/dev/null; ip netns del "$nsb" 2>/dev/null; rm -rf "$work"; }
work="$(mktemp -d)"
trap cleanup EXIT
ip netns add "$nsb" || skip "cannot make a second network namespace"
ip link add "${tag}x" type veth peer name "${tag}y" || skip "cannot make a veth pair"
ip link set "${tag}x" netns "$nsa" && ip link set "${tag}y" netns "$nsb" || exit 1
ip -n "$nsa" addr add 10.213.7.1/24 dev "${tag}x" && ip -n "$nsb" addr add 10.213.7.2/24 dev "${tag}y"
for ns in "$nsa" "$nsb"; do
  ip -n "$ns" link set lo up
done
ip -n "$nsa" link set "${tag}x" up && ip -n "$nsb" link set "${tag}y" up || exit 1

# The launcher: "ssh host cmd..." becomes "ip netns exec <host's namespace> cmd...".
cat > "$work/agent" <<AGENT
#!/bin/sh
host="\$1"; shift
case "\$host" in
  10.213.7.1) ns=$nsa ;;
  10.213.7.2) ns=$nsb ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" sh -c "\$*"
AGENT
chmod +x "$work/agent"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
echo "netns_run: namespaces $nsa (10.213.7.1) and $nsb (10.213.7.2), veth ${tag}x <-> ${tag}y"
# Both ranks on "remote" hosts through the agent (mpirun's own namespace is
# $nsa; the rank there is started through the agent too, so both go the same way).
ip netns exec "$nsa" timeout 120 mpirun -np 2 --host 10.213.7.1:1,10.213.7.2:1 \
  --mca plm_rsh_agent "$work/agent" --mca plm_rsh_no_tree_spawn 1 \
  --mca btl tcp,self --mca btl_tcp_if_include 10.213.7.0/24 \
  --mca oob_tcp_if_include 10.213.7.0/24 \
  --mca pml ob1 \
  -x OMP_NUM_THREADS -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
  sh -c 'echo "netns_run: rank $OMPI_COMM_WORLD_RANK in $(ip netns identify $$)"; exec "$0" "$@"' "$prog" "$vs"
rc=$?
echo "netns_run: mpirun exited $rc"
exit $rc
