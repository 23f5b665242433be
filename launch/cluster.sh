#!/usr/bin/env bash
# graphline on a Ray cluster.
#
#   launch/cluster.sh head   [ray start options]               start the Ray head here (port $GRAPHLINE_RAY_PORT, 6379)
#   launch/cluster.sh worker HEAD_IP:PORT [ray start options]  join this machine to the cluster (one per GPU node)
#   launch/cluster.sh serve  HEAD_IP:PORT [serve options]      run `graphline serve --address HEAD_IP:PORT ...` here
#   launch/cluster.sh up     [serve options]                   one machine: a private Ray head on 127.0.0.1 +
#                                                              `graphline serve` on it; Ctrl-C / SIGTERM stops both
#   launch/cluster.sh stop                                     `ray stop` on this machine (every Ray process of the user)
#
# A multi-node deployment, e.g. TP=8 x DP=2 on two 8-GPU nodes:
#   node A$ launch/cluster.sh head                       # prints where its token is
#   (copy node A's token file, ~/.ray/auth_token, to node B: same path, mode 600)
#   node B$ launch/cluster.sh worker NODE_A_IP:6379
#   node A$ launch/cluster.sh serve NODE_A_IP:6379 --model /ckpt/Qwen3-8B --tp 8 --dp 2 --host 0.0.0.0 --port 8000 \
#             --admin-token-file /etc/graphline/admin_token   # off loopback, serve requires an admin token
#
# Security: every cluster this script starts or joins uses Ray token authentication (RAY_AUTH_MODE=token): a
# process without the token cannot submit work. The token is read from $RAY_AUTH_TOKEN, else $RAY_AUTH_TOKEN_PATH,
# else ~/.ray/auth_token (`head` generates it there when missing); every node and every driver needs the same one.
# Ray's ports (6379 and the side ports) carry no encryption: keep them on a private network or behind a firewall
# that admits the cluster's nodes only; expose only graphline's HTTP port, with an admin token. `up` binds every
# Ray server to 127.0.0.1 and uses a token of its own in its temp dir.
#
# Environment: GRAPHLINE_RAY_PORT (head port, 0 = any free port; default 6379), GRAPHLINE_RAY_NUM_CPUS /
# GRAPHLINE_RAY_NUM_GPUS (resources of a head or worker, default: detected), GRAPHLINE_RAY_TEMP_DIR (Ray's temp dir;
# `up` makes a private one so other Ray users of the machine never attach to it), GRAPHLINE (the graphline command;
# default `graphline` when installed, else `python -m launch` from this checkout).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export RAY_AUTH_MODE=token  # every cluster this script touches authenticates (see Security above)

graphline_cmd() {
  if [[ -n "${GRAPHLINE:-}" ]]; then
    # shellcheck disable=SC2086
    echo $GRAPHLINE
  elif command -v graphline >/dev/null 2>&1; then
    echo graphline
  else
    echo "${PYTHON:-python3} -m launch"
  fi
}

resource_args() {
  local out=()
  [[ -n "${GRAPHLINE_RAY_NUM_CPUS:-}" ]] && out+=(--num-cpus "$GRAPHLINE_RAY_NUM_CPUS")
  [[ -n "${GRAPHLINE_RAY_NUM_GPUS:-}" ]] && out+=(--num-gpus "$GRAPHLINE_RAY_NUM_GPUS")
  [[ -n "${GRAPHLINE_RAY_TEMP_DIR:-}" ]] && out+=(--temp-dir "$GRAPHLINE_RAY_TEMP_DIR")
  echo "${out[@]+"${out[@]}"}"
}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit "${1:-0}"; }

cmd="${1:-}"
[[ -z "$cmd" ]] && usage 2
shift

case "$cmd" in
  head)
    if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
      ray get-auth-token --generate >/dev/null
      chmod 600 "$HOME/.ray/auth_token"
      echo "cluster.sh: Ray token in $HOME/.ray/auth_token: copy it to every worker node and driver (mode 600)" >&2
    fi
    # shellcheck disable=SC2046
    exec ray start --head --port "${GRAPHLINE_RAY_PORT:-6379}" --disable-usage-stats $(resource_args) "$@"
    ;;
  worker)
    [[ $# -ge 1 ]] || { echo "usage: $0 worker HEAD_IP:PORT [ray start options]" >&2; exit 2; }
    addr="$1"; shift
    # shellcheck disable=SC2046
    exec ray start --address "$addr" --disable-usage-stats $(resource_args) "$@"
    ;;
  serve)
    [[ $# -ge 1 ]] || { echo "usage: $0 serve HEAD_IP:PORT [graphline serve options]" >&2; exit 2; }
    addr="$1"; shift
    cd "$repo"
    # shellcheck disable=SC2046
    exec $(graphline_cmd) serve --address "$addr" --executor ray "$@"
    ;;
  up)
    tmp="${GRAPHLINE_RAY_TEMP_DIR:-$(mktemp -d /tmp/graphline-ray-XXXXXX)}"
    export GRAPHLINE_RAY_TEMP_DIR="$tmp"
    free_port() { "${PYTHON:-python3}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
    head_log="$tmp/head.log"
    # A private head: its own temp dir (ray.init() elsewhere never finds it), free side ports, every Ray server on
    # 127.0.0.1 (Ray's switch for that), and a token of its own that the head and `serve` read.
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    if [[ -z "${RAY_AUTH_TOKEN:-}" ]]; then
      (umask 077; "${PYTHON:-python3}" -c 'import secrets; print(secrets.token_hex(32))' >"$tmp/auth_token")
      export RAY_AUTH_TOKEN_PATH="$tmp/auth_token"
    fi
    # shellcheck disable=SC2046
    ray start --head --block --port "${GRAPHLINE_RAY_PORT:-0}" --disable-usage-stats --include-dashboard false \
      --dashboard-port "$(free_port)" $(resource_args) >"$head_log" 2>&1 &
    head_pid=$!
    serve_pid=""
    cleanup() {
      trap - EXIT INT TERM
      [[ -n "$serve_pid" ]] && kill -TERM "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null || true
      kill -TERM "$head_pid" 2>/dev/null && wait "$head_pid" 2>/dev/null || true
      [[ -z "${GRAPHLINE_KEEP_RAY_TEMP:-}" ]] && rm -rf "$tmp" 2>/dev/null || true
    }
    trap cleanup EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
    for _ in $(seq 1 1200); do
      [[ -s "$tmp/ray_current_cluster" ]] && break
      kill -0 "$head_pid" 2>/dev/null || { echo "cluster.sh: the Ray head failed:" >&2; cat "$head_log" >&2; exit 1; }
      sleep 0.1
    done
    [[ -s "$tmp/ray_current_cluster" ]] || { echo "cluster.sh: the Ray head did not come up" >&2; exit 1; }
    addr="$(cat "$tmp/ray_current_cluster")"
    echo "cluster.sh: Ray head at $addr (temp dir $tmp, log $head_log)" >&2
    cd "$repo"
    # shellcheck disable=SC2046
    $(graphline_cmd) serve --address "$addr" --executor ray "$@" &
    serve_pid=$!
    wait "$serve_pid"
    ;;
  stop)
    exec ray stop
    ;;
  -h|--help|help)
    usage 0
    ;;
  *)
    echo "cluster.sh: unknown command '$cmd'" >&2
    usage 2
    ;;
esac
