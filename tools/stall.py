#!/usr/bin/env python3
# Measures how long a 1 MiB prompt on one connection stalls another connection's stream (docs/benchmarks.md).
# One streaming request on connection A; after 1 s, connection B sends a ~1 MiB prompt (refused as
# too long after tokenization). Prints the largest gap between A's token events, and B's answer time.
import json, socket, subprocess, sys, time, random, threading
binary, port = sys.argv[1], int(sys.argv[2])
srv = subprocess.Popen([binary, "serve", "--model", "smollm2-135m", "--listen", f"127.0.0.1:{port}", "--threads", "2"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
srv.stdout.readline()
def conn():
    s = socket.create_connection(("127.0.0.1", port)); return s, s.makefile("r")
a, ar = conn()
a.sendall((json.dumps({"id": 1, "prompt": "def fibonacci(n):", "max_tokens": 600, "ignore_eos": True}) + "\n").encode())
random.seed(1)
big = " ".join(random.choice(["alpha", "beta", "gamma", "foo(x)", "bar[i]", "12345"]) for _ in range(170000))[:1040000]
res = {}
def sender():
    time.sleep(1.0)
    b, br = conn()
    t = time.time()
    b.sendall((json.dumps({"id": 2, "prompt": big, "max_tokens": 4}) + "\n").encode())
    line = json.loads(br.readline())
    res["b"] = (time.time() - t, line.get("error", {}).get("code"))
th = threading.Thread(target=sender); th.start()
times = []
while True:
    v = json.loads(ar.readline())
    times.append(time.time())
    if "done" in v or "error" in v: break
th.join()
gaps = [b - a for a, b in zip(times, times[1:])]
srv.terminate(); srv.wait()
print(f"{binary}: events {len(times)}, max gap {max(gaps)*1e3:.0f} ms, median gap {sorted(gaps)[len(gaps)//2]*1e3:.1f} ms, big prompt answered in {res['b'][0]*1e3:.0f} ms ({res['b'][1]})")
