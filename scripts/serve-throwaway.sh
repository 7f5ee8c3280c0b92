# Sourced by scripts/fuzz-api and scripts/generated-clients: starts a real
# `onceflow serve` on a free loopback port, with embedded PostgreSQL in a
# throwaway folder and an admin token, and stops it (and the folder) on
# exit. Sets $dir, $port, $token and $base. Needs $bin (the binary).
dir="$(mktemp -d)"
chmod 755 "$dir" # the embedded server may run as `postgres`
export ONCEFLOW_DATA_DIR="$dir/data"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
token="$("$bin" token create --name throwaway --admin 2>/dev/null | tail -1)"
ONCEFLOW_LISTEN="127.0.0.1:$port" "$bin" serve >"$dir/serve.log" 2>&1 &
serve=$!
stop() {
  kill -TERM "$serve" 2>/dev/null || true
  wait "$serve" 2>/dev/null || true # serve stops the PostgreSQL it started
  rm -rf "$dir"
}
trap stop EXIT
base="http://127.0.0.1:$port"
for _ in $(seq 1 60); do
  curl -sf "$base/healthz" >/dev/null 2>&1 && break
  sleep 1
done
curl -sf "$base/healthz" >/dev/null || { cat "$dir/serve.log" >&2; exit 1; }
