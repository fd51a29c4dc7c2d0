#!/usr/bin/env bash
# End-to-end check of the GPU path under rlt-serve (run on the device machine from the repo root).
set -u
out=${OUT:-/tmp}
sock=/tmp/rlt-gpu-check/rlt.sock
python -m rlt_engine.cli serve --model toy-ouro --device cuda --ipc "$sock" >"$out/serve.out" 2>"$out/serve.err" &
server=$!
for _ in $(seq 1 120); do grep -q ready "$out/serve.out" 2>/dev/null && break; sleep 1; done
cat "$out/serve.out"
python -m rlt_engine.cli generate --connect "ipc://$sock" --token-ids --max-tokens 16 "Hello from the GPU"
python - "$sock" <<'PY'
import sys
from rlt_engine.client import Client, SamplingParams
with Client("ipc://" + sys.argv[1]) as client:
    outs = [client.generate(f"prompt {i}", SamplingParams(max_tokens=12, seed=i, exit_threshold=0.5)) for i in range(4)]
    for o in outs:
        print(o.token_ids, o.exit_depths, o.finish_reason)
    print(client.health())
PY
kill -TERM "$server"
wait "$server"
echo "rlt-serve exit code $?"
tail -n 5 "$out/serve.err"
