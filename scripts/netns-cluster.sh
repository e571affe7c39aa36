#!/usr/bin/env bash
# A Sluice cluster across network namespaces on one machine: a driver and N external workers, each
# in a network namespace of its own (its own address on a private bridge) and each worker with a
# private /tmp (its own mount namespace), optionally with a rate limit on every link. It can cut one
# worker off (its link down) or the path between two workers (blackhole routes both ways), and heal
# them. Needs root (ip netns, tc, mount).
#
#   hub namespace: bridge br0
#     ├── v-drv ── eth0 in <prefix>-drv  10.231.0.1   driver (sluice --mode cluster --workers 0)
#     ├── v-w1  ── eth0 in <prefix>-w1   10.231.0.11  sluice worker, private /tmp
#     ├── v-w2  ── eth0 in <prefix>-w2   10.231.0.12  sluice worker, private /tmp
#     └── …
#
# Commands:
#   up N [--rate RATE]        make the hub, the driver's and N workers' namespaces (removes what a
#                             previous run left first); RATE (e.g. 200mbit) limits both directions
#                             of every link (tc tbf)
#   workers N [ARGS...]       start N `sluice worker`s, one per worker namespace, joining the driver
#                             at 10.231.0.1:$DRIVER_PORT (ARGS go to each worker); logs in $STATE/
#   driver ARGS...            run `sluice ARGS... --mode cluster --workers 0 --min-workers N
#                             --driver-listen 10.231.0.1:$DRIVER_PORT` in the driver's namespace
#                             (in the foreground; its exit code is the script's)
#   run N [--rate RATE] -- ARGS...
#                             up, workers, driver ARGS, down: one command for a whole run
#   cut I | heal I            take worker I's link down / up (it reaches no one, no one reaches it)
#   cut-pair I J | heal-pair I J
#                             workers I and J cannot reach each other / can again; both still reach
#                             the driver
#   exec NAME CMD...          run CMD in namespace NAME (drv, w1, w2, …)
#   status                    namespaces, links, qdiscs and the workers' processes
#   down                      stop every process in the namespaces and remove them and their links
#
# Environment: SLUICE_BIN (default: target/release/sluice, else target/debug/sluice, else `sluice`
# on PATH), SLUICE_SECRET (default: a random one, shared by the driver and the workers),
# NETNS_PREFIX (default sln), DRIVER_PORT (default 50050), STATE (default /tmp/sluice-netns: the
# secret, the workers' logs and pids).
#
# Data the workers read must be outside /tmp (each worker has its own /tmp) and readable by path
# from every namespace, as on machines that share a mount.
set -euo pipefail

# Read here and unset: sluice refuses SLUICE_* variables it does not know.
BIN_OVERRIDE="${SLUICE_BIN:-}"
unset SLUICE_BIN
PREFIX="${NETNS_PREFIX:-sln}"
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || {
    echo "netns-cluster: NETNS_PREFIX must be 1 to 8 lower-case letters and digits" >&2
    exit 1
}
HUB="$PREFIX-hub"
SUBNET=10.231.0
DRIVER_ADDRESS="$SUBNET.1"
DRIVER_PORT="${DRIVER_PORT:-50050}"
STATE="${STATE:-/tmp/sluice-netns}"

die() {
    echo "netns-cluster: $*" >&2
    exit 1
}

need_root() {
    [ "$(id -u)" = 0 ] || die "needs root (ip netns, tc and mount); run it with sudo"
    command -v ip > /dev/null || die "needs ip (iproute2)"
}

sluice_bin() {
    if [ -n "$BIN_OVERRIDE" ]; then
        echo "$BIN_OVERRIDE"
    elif [ -x target/release/sluice ]; then
        echo "$PWD/target/release/sluice"
    elif [ -x target/debug/sluice ]; then
        echo "$PWD/target/debug/sluice"
    elif command -v sluice > /dev/null; then
        command -v sluice
    else
        die "no sluice binary: build one (cargo build) or set SLUICE_BIN"
    fi
}

worker_ns() { echo "$PREFIX-w$1"; }
worker_address() { echo "$SUBNET.$((10 + $1))"; }

# Every namespace this script made (by its prefix), the hub last.
our_namespaces() {
    ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^$PREFIX-(drv|w[0-9]+)$" || true
    ip netns list 2> /dev/null | awk '{print $1}' | grep -x "$HUB" || true
}

down() {
    need_root
    local ns pids
    for ns in $(our_namespaces); do
        pids="$(ip netns pids "$ns" 2> /dev/null || true)"
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2> /dev/null || true
        fi
    done
    for _ in $(seq 20); do
        local left=""
        for ns in $(our_namespaces); do
            left="$left$(ip netns pids "$ns" 2> /dev/null || true)"
        done
        [ -z "$left" ] && break
        sleep 0.1
    done
    for ns in $(our_namespaces); do
        pids="$(ip netns pids "$ns" 2> /dev/null || true)"
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086
            kill -KILL $pids 2> /dev/null || true
        fi
    done
    # Deleting a namespace removes its end of every veth pair, and with it the other end.
    for ns in $(our_namespaces); do
        ip netns del "$ns" 2> /dev/null || true
    done
}

# Adds namespace $1 with address $2 on the hub's bridge through the pair v-$3 (hub) / eth0 ($1).
attach() {
    local ns="$1" address="$2" link="v-$3" rate="$4"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "$link" netns "$HUB" type veth peer name eth0 netns "$ns"
    ip -n "$HUB" link set "$link" master br0
    ip -n "$HUB" link set "$link" up
    ip -n "$ns" addr add "$address/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [ -n "$rate" ]; then
        # Both directions: out of the namespace (its eth0) and into it (the hub's end).
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
        ip netns exec "$HUB" tc qdisc add dev "$link" root tbf rate "$rate" burst 256kb latency 100ms
    fi
}

up() {
    need_root
    local count="${1:-}" rate=""
    [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le 200 ] ||
        die "up needs a worker count (1 to 200), got '${count}'"
    shift
    while [ $# -gt 0 ]; do
        case "$1" in
        --rate)
            rate="${2:-}"
            [ -n "$rate" ] || die "--rate needs a value such as 200mbit"
            shift 2
            ;;
        *) die "up: unknown argument '$1'" ;;
        esac
    done
    down
    mkdir -p "$STATE"
    rm -f "$STATE"/worker-*.log "$STATE"/worker-*.pid
    echo "$count" > "$STATE/workers"
    ip netns add "$HUB"
    ip -n "$HUB" link set lo up
    ip -n "$HUB" link add br0 type bridge
    ip -n "$HUB" link set br0 up
    attach "$PREFIX-drv" "$DRIVER_ADDRESS" drv "$rate"
    local i
    for i in $(seq "$count"); do
        attach "$(worker_ns "$i")" "$(worker_address "$i")" "w$i" "$rate"
    done
    echo "netns-cluster: driver at $DRIVER_ADDRESS, $count worker namespace(s) $SUBNET.11-$SUBNET.$((10 + count))${rate:+, links limited to $rate}"
}

secret() {
    if [ -n "${SLUICE_SECRET:-}" ]; then
        echo "$SLUICE_SECRET"
        return
    fi
    mkdir -p "$STATE"
    if [ ! -s "$STATE/secret" ]; then
        (umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$STATE/secret")
    fi
    cat "$STATE/secret"
}

start_workers() {
    need_root
    local count="${1:-}"
    [[ "$count" =~ ^[0-9]+$ ]] || die "workers needs a count"
    shift
    local bin i ns
    bin="$(sluice_bin)"
    local shared
    shared="$(secret)" || die "cannot make the cluster secret in $STATE"
    for i in $(seq "$count"); do
        ns="$(worker_ns "$i")"
        ip netns list | awk '{print $1}' | grep -qx "$ns" || die "no namespace $ns: run up first"
        # A private /tmp: the worker's spill files and blocking outputs stay its own.
        SLUICE_SECRET="$shared" setsid ip netns exec "$ns" unshare --mount --propagation private \
            sh -c 'mount -t tmpfs sluice-tmp /tmp && exec "$@"' sh \
            "$bin" worker --driver "$DRIVER_ADDRESS:$DRIVER_PORT" \
            --listen "$(worker_address "$i"):0" "$@" \
            > "$STATE/worker-$i.log" 2>&1 < /dev/null &
        echo $! > "$STATE/worker-$i.pid"
    done
    echo "netns-cluster: started $count worker(s); logs in $STATE/worker-N.log"
}

driver() {
    need_root
    local count bin shared
    count="$(cat "$STATE/workers" 2> /dev/null)" || die "run up first"
    bin="$(sluice_bin)"
    shared="$(secret)" || die "cannot make the cluster secret in $STATE"
    SLUICE_SECRET="$shared" ip netns exec "$PREFIX-drv" "$bin" "$@" --mode cluster \
        --workers 0 --min-workers "$count" --driver-listen "$DRIVER_ADDRESS:$DRIVER_PORT"
}

cut() {
    need_root
    ip -n "$HUB" link set "v-w$1" down
    echo "netns-cluster: worker $1 cut off"
}

heal() {
    need_root
    ip -n "$HUB" link set "v-w$1" up
    echo "netns-cluster: worker $1 healed"
}

pair() {
    need_root
    local verb="$1" i="$2" j="$3"
    ip -n "$(worker_ns "$i")" route "$verb" blackhole "$(worker_address "$j")/32" ||
        die "route $verb in worker $i failed"
    ip -n "$(worker_ns "$j")" route "$verb" blackhole "$(worker_address "$i")/32" ||
        die "route $verb in worker $j failed"
}

status() {
    local ns
    for ns in $(our_namespaces); do
        echo "== $ns"
        ip -n "$ns" -brief addr show 2> /dev/null | grep -v '^lo' || true
        ip -n "$ns" route show type blackhole 2> /dev/null | sed 's/^/   /' || true
        ip netns exec "$ns" tc qdisc show 2> /dev/null | grep tbf | sed 's/^/   /' || true
        echo "   processes: $(ip netns pids "$ns" 2> /dev/null | tr '\n' ' ')"
    done
}

run() {
    local count="${1:-}"
    shift || true
    local up_args=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
        up_args+=("$1")
        shift
    done
    [ "${1:-}" = "--" ] || die "run N [--rate RATE] -- SLUICE-ARGS..."
    shift
    # Removed however the run ends; the driver's exit code is the script's.
    trap 'down || true' EXIT
    up "$count" ${up_args[@]+"${up_args[@]}"}
    start_workers "$count"
    local code=0
    driver "$@" || code=$?
    return "$code"
}

command="${1:-}"
shift || true
case "$command" in
up) up "$@" ;;
down) down ;;
workers) start_workers "$@" ;;
driver) driver "$@" ;;
run) run "$@" ;;
cut) cut "${1:?cut needs a worker number}" ;;
heal) heal "${1:?heal needs a worker number}" ;;
cut-pair)
    pair add "${1:?cut-pair I J}" "${2:?cut-pair I J}"
    echo "netns-cluster: workers $1 and $2 cut from each other"
    ;;
heal-pair)
    pair del "${1:?heal-pair I J}" "${2:?heal-pair I J}"
    echo "netns-cluster: workers $1 and $2 reach each other again"
    ;;
exec)
    ns="${1:?exec NAME CMD...}"
    shift
    ip netns exec "$PREFIX-$ns" "$@"
    ;;
status) status ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    [ -z "$command" ] || [ "$command" = help ] || [ "$command" = -h ] || exit 1
    ;;
esac
