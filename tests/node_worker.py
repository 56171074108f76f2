"""A stand-in worker for the multi-node launcher tests: no TensorFlow.

    python node_worker.py DIR PLAN

It writes DIR/<attempt>.<index>.env (the launcher's emulation variables)
and DIR/<attempt>.<index>.pid (its pid) at start, then does what
PLAN (JSON: {"<attempt>.<index>": action}) says for its attempt
(OSCARS_LAUNCH_ATTEMPT) and task index (TF_CONFIG); the default is
"finish". Actions:
  finish        exit 0 (after DIR/go exists, when PLAN has "wait_go")
  fail          exit 3
  die           write DIR/<attempt>.<index>.died, then SIGKILL itself
  lost_peer     exit 75 once some DIR/<attempt>.*.died exists
  hang          sleep until signalled
At a clean exit it writes DIR/<attempt>.<index>.done.
"""

import glob
import json
import os
import signal
import sys
import time

out, plan = sys.argv[1], json.loads(sys.argv[2])
attempt = os.environ["OSCARS_LAUNCH_ATTEMPT"]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
me = os.path.join(out, f"{attempt}.{index}")
with open(me + ".env", "w") as f:  # what the launcher set, per worker
  json.dump({k: v for k, v in os.environ.items()
             if k in ("OSCARS_CPU_LIMIT", "OSCARS_SIMULATE_STEP_TIME")}, f)
with open(me + ".pid", "w") as f:  # last: the tests wait for it
  f.write(str(os.getpid()))
action = plan.get(f"{attempt}.{index}", "finish")
deadline = time.monotonic() + 60  # never outlive a broken test
if action == "fail":
  sys.exit(3)
if action == "die":
  open(me + ".died", "w").close()
  os.kill(os.getpid(), signal.SIGKILL)
if action == "lost_peer":
  while not glob.glob(os.path.join(out, f"{attempt}.*.died")):
    if time.monotonic() > deadline:
      sys.exit(4)
    time.sleep(0.02)
  sys.exit(75)
if action == "hang" or (action == "finish" and plan.get("wait_go")):
  while not os.path.exists(os.path.join(out, "go")) or action == "hang":
    if time.monotonic() > deadline:
      sys.exit(4)
    time.sleep(0.02)
open(me + ".done", "w").close()
